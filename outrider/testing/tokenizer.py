"""A byte-level BPE tokenizer with chat special tokens and a ChatML template, built offline."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def build_tokenizer(
    path: Path, extra_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> int:
    """Byte-level BPE tokenizer (no merges) with chat special tokens; returns its size.

    `extra_tokens` become ordinary added tokens (whole words or markup, one id each) after the
    special ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens])
    chat_tokenizer(tok, chat_template).save_pretrained(str(path))
    return len(vocab) + len(SPECIAL_TOKENS) + len(extra_tokens)


def chat_tokenizer(tok, chat_template: str = CHAT_TEMPLATE):
    """A `tokenizers` tokenizer that holds SPECIAL_TOKENS, as a transformers fast tokenizer with
    the chat roles (end of turn, padding, the other specials) and `chat_template` set."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = chat_template
    return fast
