"""Tiny real-architecture models for tests (ours and plugin authors').

`make_tiny_target` writes a Hugging Face style folder (config.json, safetensors, a byte-level
tokenizer with a chat template, all built offline) of a real mlx-lm architecture at toy size in
float32, with random weights. `make_tiny_drafter` writes a random-weight drafter for such a
target laid out exactly like the published checkpoints. `OracleProposer` drafts the known
answer with a chosen per-token acceptance rate.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .core.drafter_spec import DrafterSpec
from .core.proposer import DraftContext, Proposal

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

SANDWICH_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")

# Tiny sliding windows, so that short generations wrap them many times over.
SLIDING_WINDOW = 8

_GATED_DELTA = {  # every other layer gated-delta-net linear attention, the rest full attention
    "head_dim": 16,
    "tie_word_embeddings": False,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
_MROPE = {
    "type": "default",
    "mrope_section": [2, 1, 1],
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}

FAMILIES = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": False},
    "llama": {
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {"model_type": "qwen3_5", **_GATED_DELTA, "rope_parameters": _MROPE},
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        **_GATED_DELTA,
        "rope_parameters": _MROPE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "head_dim": 16,
        "tie_word_embeddings": False,
        "hybrid_override_pattern": ["M", "*", "M", "E"],
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": True,
        "final_logit_softcapping": 30.0,
    },
    "prism_hadamard_qwen35": {  # Ternary-Bonsai packs: 2-bit weights, Hadamard-rotated inputs
        "model_type": "prism_hadamard_qwen35",
        "text_config": "qwen3_5",
        # packed input widths are multiples of 128; Hadamard blocks are 512 or more
        "text_overrides": {"hidden_size": 128, "intermediate_size": 512},
        "schema_version": 1,
        "tensor_namespace": "mlx-lm-text",
        "gdn_activation_layout": "grouped",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [
            {
                "path": f"model.layers.{i}.mlp.{proj}",
                "embedding": False,
                "dtype": "float16",
                "block": block,
            }
            for i in range(4)
            for proj, block in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 512))
        ],
    },
    "gemma4": {  # the mlx-vlm multimodal checkpoint: language tower + a toy vision tower
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": "gemma4_text",
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 4,
            "position_embedding_size": 64,
            "pooling_kernel_size": 2,
            "default_output_length": 4,
        },
        "audio_config": None,
        "image_token_id": 258,
        "audio_token_id": 259,
        "boi_token_id": 257,
        "eoi_token_id": 256,
        "boa_token_id": 255,
        "eoa_token_id": 254,
    },
    "muse_glimmer_vlm": {  # the mlx-vlm multimodal checkpoint of muse_glimmer
        "model_type": "muse_glimmer",
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "text_config": "muse_glimmer",
        "text_overrides": {
            "model_type": "muse_glimmer_text",
            "bos_token_id": None,
            "eos_token_id": None,
        },
        "vision_config": {
            "model_type": "muse_glimmer_vision",
            "patch_size": 4,
            "merge_size": 2,
            "pos_emb_height": 4,
            "pos_emb_width": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "max_position_embeddings": 64,
        },
        "image_token_id": 258,
        "video_token_id": 259,
        "out_hidden_size": 64,
        "projector_hidden_size": 64,
    },
    "muse_glimmer": {
        "model_type": "muse_glimmer",
        "head_dim": 16,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
    },
}


def build_tokenizer(
    path: Path, extra_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> int:
    """Byte-level BPE tokenizer (no merges) with chat special tokens; returns its size.

    `extra_tokens` become ordinary added tokens (whole words or markup, one id each) after the
    special ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return len(vocab) + len(SPECIAL_TOKENS) + len(extra_tokens)


def tiny_config(family: str = "qwen3", vocab_size: int = 262, **overrides) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"make_tiny_target knows {sorted(FAMILIES)}, not {family!r}")
    cfg = {
        "architectures": ["TinyForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    spec = FAMILIES[family]
    if "text_config" in spec:  # a multimodal checkpoint: the text model's config nests
        overrides = {**spec.get("text_overrides", {}), **overrides}
        text = tiny_config(spec["text_config"], vocab_size, **overrides)
        for key in ("architectures", "torch_dtype"):
            text.pop(key)
        top = {k: v for k, v in spec.items() if k not in ("text_config", "text_overrides")}
        top.setdefault("architectures", ["TinyForConditionalGeneration"])
        top.update(text_config=text, vocab_size=text["vocab_size"], torch_dtype="float32")
        top["hidden_size"] = text["hidden_size"]
        return top
    cfg.update(spec)
    cfg.update(overrides)
    return cfg


def text_config(config: dict) -> dict:
    """The language model's fields, whether config.json nests them or not."""
    return {**config, **config.get("text_config", {})}


def build_model(config: dict, seed: int = 0, scale: float = 4.0):
    """An mlx-lm model of the config's architecture with random weights.

    The output head is scaled up so that greedy choices are decisive (random models otherwise
    produce near-uniform logits where fp rounding could flip an argmax).
    """
    mx.random.seed(seed)
    if "vision_config" in config:
        model = _vlm_model(config)
    else:
        from mlx_lm.utils import _get_classes

        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    sandwich = text_config(config).get("model_type") == "gemma4_text"
    for name in params:
        if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
            params[name] = params[name] * scale
        elif sandwich and name.endswith(SANDWICH_NORMS):
            # Gemma scales its tied embedding by sqrt(hidden): without louder layer outputs a
            # random model only echoes its input token.
            params[name] = params[name] * 16.0
    _randomize_packed(params)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


def _vlm_model(config: dict):
    """An mlx-vlm model (all towers) of the config's architecture."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    model_cls, _ = get_model_and_args(config=config)
    model_config = model_cls.ModelConfig.from_dict(copy.deepcopy(config))
    model_config = update_module_configs(
        model_config, model_cls, copy.deepcopy(config), ["text", "vision", "audio"]
    )
    return model_cls.Model(model_config)


def _randomize_packed(params: dict) -> None:
    """Give quantized (packed) layers random codes, scales and signs; they start as zeros."""
    for name, value in params.items():
        if value.dtype == mx.uint32 and name.endswith(".weight"):
            bits = mx.random.randint(0, 2**16, value.shape).astype(mx.uint32)
            params[name] = bits * 65537
        elif name.endswith(".scales"):
            params[name] = (0.05 + 0.05 * mx.random.uniform(shape=value.shape)).astype(value.dtype)
        elif name.endswith(".biases"):
            params[name] = mx.full(value.shape, -0.1, dtype=value.dtype)
        elif name.endswith(".signs"):
            params[name] = mx.where(mx.random.uniform(shape=value.shape) < 0.5, -1.0, 1.0)


def make_tiny_target(path: str | Path, family: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Write a tiny random-weight model folder of a real mlx-lm / mlx-vlm architecture (float32).

    `family` is the mlx-lm model_type: qwen3, llama, qwen2, qwen3_moe, qwen3_5, qwen3_5_moe,
    qwen3_next, prism_hadamard_qwen35, nemotron_h, gemma4_text, muse_glimmer; or gemma4 and
    muse_glimmer_vlm for mlx-vlm multimodal checkpoints (language tower + a toy vision tower).
    Sliding windows are `SLIDING_WINDOW` tokens, so short generations wrap them.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    overrides.setdefault("vocab_size", vocab)
    config = tiny_config(family, **overrides)
    config["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>") + vocab - len(SPECIAL_TOKENS)
    model = build_model(config, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _weight(weights: dict, suffixes: tuple[str, ...], default=None):
    """The one tensor whose name ends with a suffix (embedding / head of any family)."""
    for name, value in weights.items():
        if name.endswith(suffixes) and "per_layer" not in name:
            return value
    if default is None:
        raise KeyError(f"no tensor named *{suffixes[0]}")
    return default


def default_tap_ids(num_layers: int, n: int = 3) -> list[int]:
    """Evenly spread taps below the last layer (DeepSpec never taps the final layer)."""
    n = max(1, min(n, num_layers - 1))
    step = (num_layers - 1) / n
    return sorted({int(i * step) for i in range(n)})


TOY_WORDS = ["alpha", "beta", "gamma", "delta", "sea", "sun", "code", "list", "tree", "map"]


def make_toy_training_set(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """(target folder, prompts.jsonl) for drafter-training tests: a learnable tiny target.

    A random tiny model is close to uniform and its continuations are noise no drafter can
    learn; with its attention and MLP outputs scaled down it becomes nearly a bigram model
    (still a real qwen3 with real context effects), so its own answers follow a chain a drafter
    can pick up in a few dozen steps.
    """
    root = Path(root)
    target = make_tiny_target(root / "target", seed=seed)
    weights = dict(mx.load(str(target / "model.safetensors")))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    rng = random.Random(seed)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(19):
            words = " ".join(rng.choice(TOY_WORDS) for _ in range(3))
            f.write(json.dumps({"turns": [words]}) + "\n")
    return target, prompts


def make_tiny_drafter(
    path: str | Path,
    target: str | Path,
    kind: str = "dspark",
    packaging: str = "deepspec",
    *,
    num_layers: int = 2,
    block_size: int | None = None,
    markov_rank: int = 16,
    markov_type: str = "vanilla",
    confidence: bool = True,
    target_layer_ids: list[int] | None = None,
    seed: int = 1,
) -> Path:
    """Write a random-weight drafter for `target`, laid out like the published checkpoints."""
    from .plugins.strategies.block_drafter import BlockDrafter

    if kind not in ("dspark", "dflash"):
        raise ValueError(f"kind must be dspark or dflash, got {kind!r}")
    if packaging not in ("deepspec", "zlab"):
        raise ValueError(f"packaging must be deepspec or zlab, got {packaging!r}")
    if packaging == "zlab" and kind != "dflash":
        raise ValueError("z-lab publishes DFlash drafters only")
    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = text_config(json.loads((target / "config.json").read_text()))
    for key in ("text_config", "vision_config", "audio_config", "quantization", "modules"):
        tcfg.pop(key, None)
    L = tcfg["num_hidden_layers"]
    ids = target_layer_ids or default_tap_ids(L)
    hidden, heads = tcfg["hidden_size"], tcfg["num_attention_heads"]
    mask_id = tcfg["vocab_size"] - 1  # <|mask|> is the last special token
    deepspec = packaging == "deepspec"
    rank = markov_rank if kind == "dspark" else 0
    block = block_size or (4 if deepspec else 8)
    spec = DrafterSpec(
        format=packaging,
        kind=kind,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=tcfg.get("num_key_value_heads", heads),
        head_dim=tcfg.get("head_dim", hidden // heads),
        intermediate_size=tcfg["intermediate_size"],
        vocab_size=tcfg["vocab_size"],
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        rope_theta=tcfg.get("rope_theta", 10000.0),
        block_size=block,
        logits_start=0 if deepspec else 1,
        mask_token_id=mask_id,
        target_layer_ids=tuple(ids),
        own_embedding=deepspec,
        own_lm_head=deepspec,
        markov_rank=rank,
        markov_type=markov_type,
        confidence_head=kind == "dspark" and confidence,
        confidence_with_markov=kind == "dspark" and confidence and rank > 0,
    )
    mx.random.seed(seed)
    model = BlockDrafter(spec)
    weights = dict(tree_flatten(model.parameters()))
    if deepspec:  # frozen copies of the target's embedding and head
        tw = mx.load(str(target / "model.safetensors"))
        embed = _weight(tw, ("embed_tokens.weight", "embeddings.weight"))
        weights["embed_tokens.weight"] = embed
        weights["lm_head.weight"] = _weight(tw, ("lm_head.weight",), embed)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if deepspec:
        cfg = copy.deepcopy(tcfg)
        cfg.update(
            architectures=["Qwen3DSparkModel"],
            model_type="qwen3",
            num_hidden_layers=num_layers,
            num_target_layers=L,
            layer_types=["full_attention"] * num_layers,
            block_size=block,
            mask_token_id=mask_id,
            target_layer_ids=ids,
            num_anchors=512,
            enable_confidence_head=spec.confidence_head,
            markov_rank=rank,
            tie_word_embeddings=False,
            head_dim=spec.head_dim,
        )
        if spec.confidence_head:
            cfg["confidence_head_with_markov"] = spec.confidence_with_markov
        if rank > 0:
            cfg["markov_head_type"] = markov_type
    else:
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": block,
            "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": ids},
            "hidden_size": hidden,
            "intermediate_size": tcfg["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "num_hidden_layers": num_layers,
            "num_target_layers": L,
            "rms_norm_eps": spec.rms_norm_eps,
            "rope_theta": spec.rope_theta,
            "vocab_size": tcfg["vocab_size"],
            "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # present on the hub; never run
        }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class OracleProposer:
    """Drafts the known continuation; each drafted token is right with probability `rate`.

    `reference` is the full expected sequence (prompt + plain greedy output); a wrong draft is
    the right token + 1 (mod vocab), so acceptance per token is exactly `rate` in expectation.
    """

    tap_layer_ids: tuple[int, ...] = ()

    def __init__(
        self, reference: list[int], rate: float, vocab_size: int, max_draft: int = 8, seed: int = 0
    ) -> None:
        self.name = "oracle"
        self.reference = reference
        self.rate = rate
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self._rng = random.Random(seed)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Proposal:
        m = len(ctx.tokens)
        truth = self.reference[m : m + min(ctx.cap, self.max_draft)]
        drafts = [t if self._rng.random() < self.rate else (t + 1) % self.vocab_size for t in truth]
        return Proposal.from_list(drafts)

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass


def cast_model(model, dtype) -> None:
    """Cast a model's floating parameters in place (benchmarks build bf16 models this way)."""
    model.update(
        tree_map(
            lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )


# --- a scripted target: a real architecture whose answers are known in advance ----------------

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


def make_scripted_target(path: str | Path, script: list[list[str]] = SCRIPT) -> Path:
    """Write a one-layer Llama whose next token depends only on the current one, following
    `script` (anything unscripted is followed by <|im_end|>); its chat template supports
    system prompts, tools, tool results, `enable_thinking` and `reasoning_effort`.

    Attention and MLP outputs are zero and the embedding is one-hot, so the logits are the
    output head's column for the current token: greedy and sampled output are the script. The
    template's cues make tool calls, thinking and tool results testable end to end.
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
        num_attention_heads=4,
        num_key_value_heads=4,
    )
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
