"""A GGUF target's tokenizer, rebuilt from the file's metadata (`outrider/core/gguf_tokenizer.py`):
byte-level BPE under every pre-tokenizer name llama.cpp reads, llama.cpp's BOS defaults, and
SentencePiece vocabularies tokenized as llama.cpp does."""

from __future__ import annotations

import random

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import gguf, gguf_header
from outrider.testing import make_tiny_gguf


@pytest.mark.parametrize(
    "pre,text,pieces",
    [  # tekken splits an upper-case run off the next word and every digit; qwen2 every digit
        ("tekken", "HelloWORLDWide 123", ["Hello", "WORLDWide", " ", "1", "2", "3"]),
        ("deepseek-r1-qwen", "HelloWORLD 123", ["HelloWORLD", " ", "1", "2", "3"]),
        ("falcon3", "Hello 12345", ["Hello", " ", "123", "45"]),  # Llama 3's: digits in threes
        ("gpt-4o", "HelloWORLDWide's 12345", ["Hello", "WORLDWide's", " ", "123", "45"]),
        ("dbrx", "Hello's 12345", ["Hello", "'s", " ", "123", "45"]),  # Llama 3's split
    ],
)
def test_pre_tokenizers_of_other_names(tmp_path, llama_target, pre, text, pieces):
    """Files name their pre-tokenizer as llama.cpp reads it; its expression splits the text."""
    path = make_tiny_gguf(tmp_path / "t.gguf", llama_target, tokenizer_pre=pre)
    split = gguf.build_tokenizer(path)._tokenizer.backend_tokenizer.pre_tokenizer
    got = [piece for piece, _ in split.pre_tokenize_str(text)]
    byte_level = {" ": "Ġ"}  # the byte-level step after the split shows a space as Ġ
    assert got == ["".join(byte_level.get(c, c) for c in p) for p in pieces]


@pytest.mark.parametrize("pre,add_bos,adds", [("tekken", None, True), ("llama-bpe", None, True),
                                              ("tekken", False, False), ("gpt2", None, False),
                                              ("dbrx", None, False)])  # fmt: skip
def test_a_bos_by_llama_cpps_defaults(tmp_path, llama_target, pre, add_bos, adds):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds a BOS for Llama 3's and tekken's
    pre-tokenizers, and not for the rest; the key, where present, decides."""
    path = make_tiny_gguf(
        tmp_path / "b.gguf", llama_target, tokenizer_pre=pre, bos_token="<|endoftext|>",
        add_bos=add_bos,
    )  # fmt: skip
    tok = gguf.build_tokenizer(path)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.encode("hi")[0] == bos) is adds


def spm_reference(
    text: str, tokens: list[str], scores: list[float], prefix: bool = True
) -> list[int]:
    """llama.cpp's SentencePiece tokenization, spelled out: spaces become "▁", one is prefixed
    (unless the file says add_space_prefix = false, as Gemma's do), the adjacent pair whose join is a piece with the highest score merges (the leftmost on a
    tie) until none is, and a symbol that is no piece is spelled as byte pieces."""
    ids = {t: i for i, t in enumerate(tokens) if i >= 259}  # pieces (not <unk>/<s>/</s>/bytes)
    symbols = list(("\u2581" if prefix else "") + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = ids.get(symbols[i] + symbols[i + 1])
            if joined is not None and (best is None or scores[joined] > best[0]):
                best = (scores[joined], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for sym in symbols:
        out.extend([ids[sym]] if sym in ids else [3 + b for b in sym.encode()])
    return out


@pytest.fixture(scope="module")
def spm_gguf(models_dir):
    return make_tiny_gguf(
        models_dir / "llama-spm.gguf",
        family="llama",
        tokenizer_pre="sentencepiece",
        vocab_size=340,
        add_bos=None,  # llama.cpp's default for SentencePiece: a BOS
    )


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(spm_gguf):
    """On random text over the corpus' letters, spaces, punctuation and characters the
    vocabulary lacks, the rebuilt tokenizer gives llama.cpp's ids (the procedure written out
    in `spm_reference`), adds a BOS by default, and decodes back to the text."""
    meta = gguf_header.read_header(spm_gguf).metadata
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"].tolist()
    tok = gguf.build_tokenizer(spm_gguf)
    rng = random.Random(0)
    alphabet = list("thequickbrownfoxjumpsoverlazydog") + [" "] * 6 + list(",.é→ZQ")
    texts = ["the fox", "the  dog sleeps", " leading", "trailing ", "ünï → ok"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    for text in texts:
        want = spm_reference(text, tokens, scores)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.encode(text) == [1, *want]
        assert tok.decode(want) == text, text


def test_a_vocabulary_without_a_space_prefix_tokenizes_as_llama_cpp_does(tmp_path):
    """Gemma's files say add_space_prefix = false: no "▁" is put before the text, so a text
    that starts with a word starts with that word's piece, and decoding keeps a leading space
    the text really had."""
    path = make_tiny_gguf(
        tmp_path / "g.gguf", family="llama", tokenizer_pre="sentencepiece", vocab_size=340,
        space_prefix=False,
    )  # fmt: skip
    meta = gguf_header.read_header(path).metadata
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"].tolist()
    tok = gguf.build_tokenizer(path)
    rng = random.Random(1)
    alphabet = list("thequickbrownfoxjumpsoverlazydog") + [" "] * 6 + list(",.é")
    texts = ["the fox", " leading", "  two", "trailing "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    for text in texts:
        want = spm_reference(text, tokens, scores, prefix=False)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want) == text, text
    assert want != spm_reference(text, tokens, scores)  # the prefix changes the ids
    wrapper = gguf.build_tokenizer(path)  # streamed text keeps its leading space too
    detokenizer = wrapper.detokenizer
    detokenizer.reset()
    for t in wrapper.encode(" leading words", add_special_tokens=False):
        detokenizer.add_token(t)
    detokenizer.finalize()
    assert detokenizer.text == " leading words"


def test_a_sentencepiece_file_generates_and_streams(spm_gguf):
    pipe = outrider.load(str(spm_gguf), mode="lookup")
    ids = pipe.encode("the quick brown fox")
    assert ids.count(1) == 1 and ids[0] == 1  # the template's BOS, not a second one
    assert pipe.tokenizer.decode(ids[1:]) == "[INST] the quick brown fox [/INST]"
    res = pipe.generate(ids, max_tokens=16, stop_tokens=set())
    assert res.tokens == plain_greedy(spm_gguf, ids, 16)
    text = "the lazy fox → ünï, ok"  # SentencePiece's streaming detokenizer, token by token
    detokenizer = pipe.tokenizer.detokenizer
    detokenizer.reset()
    for t in pipe.tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(t)
    detokenizer.finalize()
    assert detokenizer.text == text


def test_tokenizer_comes_from_the_metadata(tmp_path, llama_target):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = make_tiny_gguf(tmp_path / "t.gguf", llama_target)
    want, got = load_tokenizer(llama_target), gguf.build_tokenizer(path)
    texts = [*PROMPTS, "<|im_start|>user\nhi<|im_end|>", "naïve café 12345 \t\n x"]
    for text in texts:
        assert got.encode(text) == want.encode(text)
        assert got.decode(want.encode(text)) == text
    assert got.chat_template == want.chat_template
    assert got.eos_token_ids == want.eos_token_ids == {258}  # <|im_end|>, from the metadata
    assert got.pad_token_id == 256 and got.bos_token_id is None
