"""A GGUF file's tokenizer, rebuilt with Hugging Face `tokenizers` from its metadata.

Two vocabularies, as llama.cpp names them in `tokenizer.ggml.model`:

* `gpt2`, byte-level BPE (Llama 3, Qwen, SmolLM2, Mistral's tekken): the vocabulary and merges,
  split first by the expressions llama.cpp applies for `tokenizer.ggml.pre`
  (`llama-vocab.cpp`), under every name llama.cpp reads for them.
* `llama`, SentencePiece (Llama 2, Mistral 7B, TinyLlama, Gemma 3): pieces with scores and no
  merges. llama.cpp tokenizes such text by replacing spaces with "▁", prefixing one (unless
  `tokenizer.ggml.add_space_prefix` is false, as Gemma's converter writes), and merging the
  adjacent pair whose joined piece scores highest until none is in the vocabulary, spelling what
  is left as byte tokens (<0x41>). A BPE whose merges are every (left, right) split of a piece,
  ranked by that piece's score, does the same (the conversion transformers makes of a
  SentencePiece model); byte fallback covers the rest. `tests/test_gguf.py` checks it against a
  direct implementation of llama.cpp's procedure on random text.

Control tokens (type 3) are special, user-defined ones (4) matched whole; a BOS is added where
`tokenizer.ggml.add_bos_token` says so or, without that key, by llama.cpp's default.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .errors import CheckpointError

# tokenizer.ggml.pre -> the split expressions llama.cpp applies, in order (llama-vocab.cpp).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral Nemo, Small 3.x): tokenizer.json's own expression, which llama.cpp
# quotes beside the rewrite its regex engine needs (an upper-case run splits off the next word).
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k split (GPT-4o's; Llama 4's): tekken's, with contractions and digits in
# threes; again tokenizer.json's own expression, as llama.cpp quotes it.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The names llama.cpp reads each expression for (llama-vocab.cpp, `tokenizer_pre`).
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2")
_SAME = [
    ((_GPT2,), ("default", "gpt2", "gpt-2", "phi-2", "mellum")),
    ((r"\p{N}", _GPT2), ("smollm", "starcoder", "refact")),
    ((_LLAMA3,), _LLAMA3_NAMES),
    ((_LLAMA3,), ("dbrx", "smaug-bpe")),  # the same split; merges kept, no BOS
    ((_QWEN2,), ("qwen2", "deepseek-r1-qwen", "megrez")),
    ((_TEKKEN,), ("tekken",)),
    ((_GPT4O,), ("gpt-4o", "llama4", "minimax-m2")),
]
PRE_TOKENIZERS = {name: list(exprs) for exprs, names in _SAME for name in names}
# llama.cpp turns merges off (a word in the vocabulary is one token) and adds a BOS by default
# for these; the file's tokenizer.ggml.add_bos_token overrides the latter.
IGNORE_MERGES = set(_LLAMA3_NAMES) | {"tekken"}
BOS_BY_DEFAULT = IGNORE_MERGES
MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece
SPACE = "\u2581"  # SentencePiece's "▁"
CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # llama.cpp's token types
NOT_PIECES = (2, CONTROL, 5, BYTE)  # unknown, control, unused, byte: never a merge's result


def check_tokenizer(metadata: dict, name: str) -> None:
    """Refuse, by name, a vocabulary this module cannot rebuild."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise CheckpointError(
            f"{name}: tokenizer model {model!r} is not supported yet (supported: 'gpt2', "
            "byte-level BPE; 'llama', SentencePiece)"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{name}: pre-tokenizer {pre!r} is not known (known: {', '.join(PRE_TOKENIZERS)})"
        )
    if model == "llama" and metadata.get("tokenizer.ggml.scores") is None:
        raise CheckpointError(f"{name}: a SentencePiece vocabulary without tokenizer.ggml.scores")


def _byte_level(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre in IGNORE_MERGES,
        )
    )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, pre in BOS_BY_DEFAULT


def spm_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray | None) -> list[tuple]:
    """Every (left, right) whose join is a normal piece, ranked by the join's score (highest
    first; within a piece by the halves' ids): llama.cpp's SentencePiece merging as BPE."""
    normal = [i for i in range(len(tokens)) if types is None or types[i] not in NOT_PIECES]
    ids = {tokens[i]: i for i in normal}
    ranked = []
    for i in normal:
        piece = tokens[i]
        halves = [
            (ids[piece[:k]], ids[piece[k:]])
            for k in range(1, len(piece))
            if piece[:k] in ids and piece[k:] in ids
        ]
        ranked.extend((-float(scores[i]), left, right) for left, right in sorted(halves))
    ranked.sort(key=lambda r: r[0])  # stable: a piece's splits stay in id order
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _sentencepiece(meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = np.asarray(meta["tokenizer.ggml.scores"], dtype=np.float64)
    types = meta.get("tokenizer.ggml.token_type")
    if len(scores) != len(tokens):
        raise CheckpointError(f"{len(scores)} SentencePiece scores for {len(tokens)} pieces")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=spm_merges(tokens, scores, types),
            unk_token=None if unk is None else tokens[int(unk)],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    # Gemma's files say add_space_prefix = false: no "▁" before the text, and none to take
    # off the decoded text's start
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPACE)]
    if prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    decoding = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decoding)
    return tok, True  # llama.cpp adds a BOS to a SentencePiece vocabulary by default


def build_tokenizer(meta: dict, name: str) -> Any:
    """A transformers fast tokenizer (in mlx-lm's wrapper) from the vocabulary, merges or
    scores, special ids and chat template in a file's metadata."""
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    check_tokenizer(meta, name)
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{name} has no tokenizer vocabulary in its metadata")
    spm = meta["tokenizer.ggml.model"] == "llama"
    tok, bos_default = (_sentencepiece if spm else _byte_level)(meta, tokens)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:  # control tokens are special; user-defined ones are matched whole
        types = np.asarray(types)
        control, user = np.flatnonzero(types == CONTROL), np.flatnonzero(types == USER_DEFINED)
        tok.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in control]
        )
        tok.add_tokens([AddedToken(tokens[i], normalized=False) for i in user])

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    if bool(meta.get("tokenizer.ggml.add_bos_token", bos_default)) and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown"),
        pad_token=special("padding"),
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = meta.get("tokenizer.chat_template")
    eos_ids = [int(meta["tokenizer.ggml.eos_token_id"])] if eos is not None else []
    if meta.get("tokenizer.ggml.eot_token_id") is not None:
        eos_ids.append(int(meta["tokenizer.ggml.eot_token_id"]))
    detokenizer = BPEStreamingDetokenizer
    if spm:  # a text decoded from the start keeps its first space where no prefix was added
        prefixed = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=prefixed)
    return TokenizerWrapper(fast, detokenizer, eos_token_ids=eos_ids)
