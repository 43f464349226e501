"""A scripted target: a real architecture whose answers are known in advance (server tests)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .configs import tiny_config
from .targets import build_model
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

SCRIPT_TEMPLATE = (
    "{%- if tools or messages[0]['role'] == 'system' or reasoning_effort is defined %}"
    "<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}"
    "{%- if reasoning_effort is defined %}\nReasoning: {{ reasoning_effort }}{%- endif %}"
    "{%- if tools %}\n# Tools\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}"
    "\n</tools>{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('System message must be at the beginning') }}"
    "{%- endif %}"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{%- for tc in m['tool_calls'] or [] %}<tool_call>\n"
    '{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{{ tc['function']['arguments'] | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n<|cue_direct|>"
    "{%- elif messages[-1]['role'] == 'tool' %}<|cue_result|>"
    "{%- elif tools %}<|cue_tools|>{%- else %}<|cue_chat|>{%- endif %}{%- endif %}"
)

TOOL_CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# Each line is a chain: every token is followed by the next. The template ends each generation
# prompt with a cue saying which line the answer takes (chat, no thinking, tool call, result).
SCRIPT = [
    ["<|cue_chat|>", "<think>", "Thinking it over.", "</think>", "The answer is 42.", "<|im_end|>"],
    ["<|cue_direct|>", "The answer is 42."],
    ["<|cue_tools|>", "<tool_call>", TOOL_CALL_JSON, "</tool_call>", "<|im_end|>"],
    ["<|cue_result|>", "It is sunny in Paris.", "<|im_end|>"],
]


def make_scripted_target(
    path: str | Path,
    script: list[list[str]] = SCRIPT,
    *,
    heads: int = 4,
    head_dim: int | None = None,
    max_positions: int = 4096,
) -> Path:
    """Write a one-layer Llama whose next token depends only on the current one, following
    `script` (anything unscripted is followed by <|im_end|>); its chat template supports
    system prompts, tools, tool results, `enable_thinking` and `reasoning_effort`.

    Attention and MLP outputs are zero and the embedding is one-hot, so the logits are the
    output head's column for the current token: greedy and sampled output are the script. The
    template's cues make tool calls, thinking and tool results testable end to end.

    Since attention changes no answer, its shape is free: `heads=1` with a small even
    `head_dim` makes prefill cheap enough for prompts of tens of thousands of (byte) tokens,
    such as Claude Code's default system prompt; `max_positions` is the native context.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    extra = tuple(dict.fromkeys(t for line in script for t in line if t not in SPECIAL_TOKENS))
    vocab = build_tokenizer(path, extra, SCRIPT_TEMPLATE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = {t: tok.convert_tokens_to_ids(t) for line in script for t in line}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    hidden = -(-vocab // 8) * 8
    config = tiny_config(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=1,
        intermediate_size=16,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
    )
    if head_dim is not None:
        config["head_dim"] = head_dim
    config["eos_token_id"] = eos
    model = build_model(config)
    nxt = [eos] * vocab
    for line in script:
        for a, b in zip(line, line[1:]):
            nxt[ids[a]] = ids[b]
    head = mx.zeros((vocab, hidden))
    head[mx.array(nxt), mx.arange(vocab)] = 1.0
    weights = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(w)
    weights["model.embed_tokens.weight"] = mx.eye(vocab, hidden)
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
