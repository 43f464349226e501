"""A quantized KV cache (`kv_bits`) changes what the target computes, never what speculation
adds: every mode's greedy output equals mlx-lm's plain decoding over the same quantized cache.

The reference is mlx-lm's `generate_step` given the caches outrider keeps from the first
prompt token on: each plain KV layer quantized, and read the way this device reads it
(core/kv_quant.py: mlx-lm's `QuantizedKVCache` and its quantized attention, or on a CUDA GPU
the same store read dequantized into dense attention). Verify forwards read the same quantized
keys one-row decoding reads, so the tokens are compared exactly.

A dense target checks every mode and bit width, both ways of reading the cache, and that the
dequantized read computes what the quantized product computes; a gated-delta, a Mamba-2 and a
sliding-window target check that only their attention layers are quantized, that every mode
still equals mlx-lm over the same mix of caches, and that prefix-cache hits restore quantized
layers exactly.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, _load_plain, load_kv_bits, plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import outrider
from outrider import doctor
from outrider.core import device
from outrider.core.device import KV_ATTENTION_ENV, kv_attention
from outrider.core.errors import OutriderError, UnsupportedTargetError
from outrider.core.kv_quant import DequantizingKVCache, quantized_kv, stored_quantized
from outrider.testing import make_tiny_drafter, make_tiny_target

_QUANTIZED_RUNS: dict[tuple, list[int]] = {}


def quantized_plain(model_path, ids: list[int], n: int, bits: int, read: str = "") -> list[int]:
    """mlx-lm's plain greedy decoding with its own caches for the model, each plain KV layer's
    replaced by a `bits`-bit quantized one read as `read` says (default: this device's way;
    sliding windows and recurrent state as they are); made once per model, prompt, length,
    bits and read (every mode compares with the same)."""
    read = read or kv_attention()
    run = (str(model_path), tuple(ids), n, bits, read)
    if run not in _QUANTIZED_RUNS:
        model = _load_plain(str(model_path))
        cache = [quantized_kv(c, bits, read) for c in make_prompt_cache(model)]
        steps = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache)
        _QUANTIZED_RUNS[run] = [int(tok) for tok, _ in steps]
    return list(_QUANTIZED_RUNS[run])


def quantized_layers(cache: list) -> list:
    return [c for c in cache if stored_quantized(c) is not None]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny qwen3 whose head dimension (64) mlx-lm can quantize, and a DSpark drafter."""
    d = tmp_path_factory.mktemp("kv")
    target = make_tiny_target(d / "t", family="qwen3", hidden_size=128, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=64)  # fmt: skip
    return target, make_tiny_drafter(d / "dspark", target, "dspark", block_size=8)


@pytest.fixture(scope="module")
def kv_heads(wide_heads):
    """`wide_heads`, where this device can attend over their quantized cache."""
    if load_kv_bits(wide_heads[0], 8, mode="baseline") is None:
        pytest.skip("--kv-bits is refused on this device (conftest.load_kv_bits)")
    return wide_heads


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mode", ["dspark", "lookup", "baseline"])
def test_every_mode_matches_plain_decoding_over_the_same_quantized_cache(kv_heads, bits, mode):
    target, drafter = kv_heads
    pipe = outrider.load(str(target), str(drafter) if mode == "dspark" else None, mode=mode,
                         kv_bits=bits)  # fmt: skip
    assert pipe.target.kv_attention == kv_attention()
    assert quantized_layers(pipe.target.make_cache())
    for prompt in PROMPTS[:2]:
        ids = pipe.encode(prompt)
        got = pipe.generate(ids, max_tokens=32, stop_tokens=set()).tokens
        assert got == quantized_plain(target, ids, 32, bits)


@pytest.mark.parametrize("mode", ["dspark", "lookup"])
def test_dequantized_reads_decode_as_mlx_lm_over_the_same_store(kv_heads, mode, monkeypatch):
    """OUTRIDER_KV_ATTENTION=dequantized (a CUDA GPU's default): every mode's output equals
    mlx-lm's decoding over the same dequantizing caches, at both widths; on the CPU, where the
    quantized product is right, it is also the tokens that product decodes."""
    monkeypatch.setenv(KV_ATTENTION_ENV, "dequantized")
    target, drafter = kv_heads
    for bits in (4, 8):
        pipe = outrider.load(str(target), str(drafter) if mode == "dspark" else None,
                             mode=mode, kv_bits=bits)  # fmt: skip
        cache = pipe.target.make_cache()
        assert pipe.target.kv_attention == "dequantized"
        assert quantized_layers(cache) and all(
            isinstance(c, DequantizingKVCache) for c in quantized_layers(cache)
        )
        ids = pipe.encode(PROMPTS[1])
        got = pipe.generate(ids, max_tokens=32, stop_tokens=set()).tokens
        assert got == quantized_plain(target, ids, 32, bits, "dequantized")
        if mx.default_device() == mx.cpu:
            assert got == quantized_plain(target, ids, 32, bits, "quantized")


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantized_attention_computes_the_quantized_product(kv_heads, bits):
    """The dequantizing cache's logits equal those of mlx-lm's quantized attention over the
    same store, computed on the CPU (where MLX's quantized product is right), to float
    rounding: a prompt forward, then a 3-row verify-like forward on top, then a trim and one
    row again."""
    target, _ = kv_heads
    model = _load_plain(str(target))

    def logits(read: str, stream) -> list[mx.array]:
        with mx.stream(stream):
            cache = [quantized_kv(c, bits, read) for c in make_prompt_cache(model)]
            out = [model(mx.array([list(range(3, 40))]), cache=cache)]
            out.append(model(mx.array([[41, 42, 43]]), cache=cache))
            for c in cache:
                c.trim(2)
            out.append(model(mx.array([[44]]), cache=cache))
            mx.eval(out)
            return [x.astype(mx.float32) for x in out]

    got = logits("dequantized", mx.default_stream(mx.default_device()))
    want = logits("quantized", mx.cpu)
    for g, w in zip(got, want, strict=True):
        scale = mx.abs(w).max().item()
        # float32 on the CPU: ~1e-6; TF32 matmuls on a CUDA GPU: ~1e-3; a wrong read: O(1)
        assert mx.abs(g - w).max().item() <= 1e-2 * scale


def test_quantized_kv_changes_the_target_computation(kv_heads):
    """The flag takes effect: 4-bit keys change a random-weight model's greedy path, and the
    pipeline follows the quantized one."""
    target, _ = kv_heads
    pipe = outrider.load(str(target), mode="baseline", kv_bits=4)
    ids = pipe.encode(PROMPTS[0])
    quantized = quantized_plain(target, ids, 48, 4)
    assert quantized != plain_greedy(target, ids, 48)
    assert pipe.generate(ids, max_tokens=48, stop_tokens=set()).tokens == quantized


def test_a_shared_target_keeps_its_kv_bits_unless_asked(kv_heads):
    """Pipelines built on one loaded target (a benchmark's arms, the compat layer's thresholds)
    keep its quantized cache: a load that names no kv_bits does not turn it off."""
    target, drafter = kv_heads
    pipe = outrider.load(str(target), mode="baseline", kv_bits=8)
    other = outrider.load(str(target), str(drafter), mode="dspark", target=pipe.target)
    assert other.target.kv_bits == 8
    assert quantized_layers(other.target.make_cache())
    outrider.load(str(target), mode="lookup", target=pipe.target, kv_bits=4)
    assert pipe.target.kv_bits == 4


def test_bad_kv_bits_are_refused(qwen3_target):
    with pytest.raises(OutriderError, match="--kv-bits must be 8 or 4"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=3)
    with pytest.raises(UnsupportedTargetError, match="head dimension divisible by 64"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=8)  # head dim 16


def test_a_device_that_cannot_attend_over_a_quantized_cache_refuses_kv_bits(
    wide_heads, monkeypatch
):
    """Where MLX has no kernel for the quantized attention (MLX 0.32's CUDA backend for the
    cache as mlx-lm hands it over), --kv-bits with that read is refused at load with one line
    naming MLX's error, not in the middle of a generation; the dequantized read never calls
    that product, so it is taken and decodes as over any dequantizing cache."""
    target, _ = wide_heads

    def no_kernel(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 3x3x64x2")

    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)  # what mlx-lm's attention calls
    monkeypatch.setenv(KV_ATTENTION_ENV, "quantized")
    with pytest.raises(UnsupportedTargetError) as refused:
        outrider.load(str(target), mode="baseline", kv_bits=4)
    assert "No implementation for problem shape" in str(refused.value)
    assert "run without --kv-bits" in str(refused.value)
    monkeypatch.setenv(KV_ATTENTION_ENV, "dequantized")
    pipe = outrider.load(str(target), mode="baseline", kv_bits=4)
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=16, stop_tokens=set()).tokens
    assert got == quantized_plain(target, ids, 16, 4, "dequantized")


def test_a_cuda_gpu_reads_a_quantized_cache_dequantized(wide_heads, monkeypatch):
    """MLX 0.32's CUDA backend decoded wrong tokens through its quantized attention at shapes a
    load check does not reach (docs/testing-on-gpu.md), so a CUDA GPU reads the cache
    dequantized by default, `outrider doctor` says which read is used, and a bad override is
    one clear error."""
    monkeypatch.setattr(device, "on_cuda_gpu", lambda: True)
    assert kv_attention() == "dequantized"
    assert doctor.doctor_report()["kv_bits"] == "8, 4 (attention reads the cache dequantized)"
    monkeypatch.setenv(KV_ATTENTION_ENV, "quantized")
    assert kv_attention() == "quantized"
    monkeypatch.setattr(device, "on_cuda_gpu", lambda: False)
    monkeypatch.delenv(KV_ATTENTION_ENV)
    assert kv_attention() == "quantized"
    monkeypatch.setenv(KV_ATTENTION_ENV, "fast")
    with pytest.raises(OutriderError, match=f"{KV_ATTENTION_ENV} must be auto, quantized or"):
        outrider.load(str(wide_heads[0]), mode="baseline", kv_bits=4)
    report = doctor.doctor_report()
    assert report["kv_bits"] is None and any(KV_ATTENTION_ENV in p for p in report["problems"])


# one target of every other cache kind, with heads mlx-lm can quantize (64 wide)
KINDS = {
    "qwen3_next": {"head_dim": 64},  # gated-delta recurrent layers between attention layers
    "nemotron_h": {"head_dim": 64},  # Mamba-2 layers between attention layers
    "gemma4_text": {"head_dim": 64, "global_head_dim": 64},  # sliding windows, global layers
}
FIRST = list(range(30, 70)) + [100, 101, 102]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """{family: (target, dspark drafter)} for `KINDS`, where this device takes --kv-bits."""
    d = tmp_path_factory.mktemp("kv-kinds")
    out = {}
    for family, heads in KINDS.items():
        target = make_tiny_target(d / family, family=family, **heads)
        out[family] = target, make_tiny_drafter(d / f"{family}-dspark", target, "dspark",
                                                "deepspec", block_size=8)  # fmt: skip
    if load_kv_bits(out["qwen3_next"][0], 8, mode="baseline") is None:
        pytest.skip("--kv-bits is refused on this device (conftest.load_kv_bits)")
    return out


@pytest.mark.parametrize("family", KINDS)
def test_every_cache_kind_decodes_a_quantized_cache_as_mlx_lm(kinds, family):
    """Gated-delta, Mamba-2 and sliding-window targets: their attention layers' caches are
    quantized and the other layers keep theirs, and every mode equals mlx-lm's decoding over
    the same caches (recurrent rollback and window trims next to quantized trims)."""
    target, drafter = kinds[family]
    want = None
    for mode in ("dspark", "lookup", "baseline"):
        pipe = outrider.load(str(target), str(drafter) if mode == "dspark" else None,
                             mode=mode, kv_bits=8)  # fmt: skip
        cache = pipe.target.make_cache()
        assert quantized_layers(cache)
        assert len(quantized_layers(cache)) < len(cache)  # the other kind is there
        ids = pipe.encode(PROMPTS[0])
        want = want or quantized_plain(target, ids, 40, 8)
        got = pipe.generate(ids, max_tokens=40, max_draft=4, stop_tokens=set()).tokens
        assert got == want, f"{family}: {mode} diverged from mlx-lm over the same caches"
    assert len(set(want)) > 4  # the toy model says something, not one token over and over


@pytest.mark.parametrize("family", KINDS)
def test_prefix_cache_hits_over_a_quantized_cache_equal_a_fresh_run(kinds, family):
    """The prefix cache keeps and restores quantized layers with the others: an exact repeat,
    a longer turn and a prompt that parts inside the first one each decode what a fresh
    --kv-bits request decodes."""
    target, drafter = kinds[family]
    pipe = outrider.load(str(target), str(drafter), mode="dspark", kv_bits=8)
    fresh = outrider.load(str(target), str(drafter), mode="dspark", target=pipe.target)
    assert fresh.target.kv_bits == 8  # a shared target keeps its setting
    pipe.enable_prefix_cache(gb=1, interval=8)

    def run(p, ids):
        return p.generate(ids, max_tokens=10, max_draft=4, stop_tokens=set())

    first = run(pipe, FIRST)
    turn = FIRST + first.tokens + [110, 111, 112]
    runs = {"first": (FIRST, first), "repeat": (FIRST, run(pipe, FIRST)),
            "turn": (turn, run(pipe, turn)), "parted": (FIRST[:21] + [200, 201], None)}  # fmt: skip
    runs["parted"] = (runs["parted"][0], run(pipe, runs["parted"][0]))
    assert runs["repeat"][1].cached_tokens == len(FIRST)
    assert runs["turn"][1].cached_tokens >= len(FIRST)
    assert runs["parted"][1].cached_tokens > 0
    for name, (ids, got) in runs.items():
        assert got.tokens == run(fresh, ids).tokens, f"{family}: the {name} run diverged"
    assert pipe.prefix_cache.snapshot_stats()["hits"] == 3
    # a toy's tokens lean little on one attention layer, so check what a hit restores, too
    target = pipe.target
    cache = target.make_cache()
    target.prefill(FIRST, cache)
    restored = target.restore(target.snapshot(cache), len(FIRST))
    quantized = [(stored_quantized(a), stored_quantized(b)) for a, b in zip(cache, restored)
                 if stored_quantized(a) is not None]  # fmt: skip
    assert quantized and all(b is not None for _, b in quantized)
    for a, b in quantized:
        assert b.offset == a.offset == len(FIRST)
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
            assert mx.array_equal(x[..., : a.offset, :], y[..., : b.offset, :])


def test_the_server_with_kv_bits_answers_as_mlx_lm_through_both_sdks(kinds):
    """`serve --kv-bits 8 --max-batch 2` on a gated-delta target with the prefix cache: through
    the real openai and anthropic SDKs, each answer is mlx-lm's decoding of the prompt over the
    same quantized caches (one request at a time: quantized caches do not batch), and a repeat
    is a whole-prompt hit with the same answer."""
    import anthropic
    import openai
    import requests
    from live_server import detok, live_server

    from outrider.core.prefix_cache import PrefixCache
    from outrider.prompts import encode_messages
    from outrider.server.engine import LoadSpec

    target, drafter = kinds["qwen3_next"]
    spec = LoadSpec(str(target), str(drafter), mode="dspark", kv_bits=8)
    messages = [{"role": "user", "content": "Say something about the sea."}]
    with live_server(spec, max_batch=2) as (url, engine):
        engine.set_prefix_cache(PrefixCache(1 << 30))
        health = requests.get(url + "/health").json()
        assert (health["kv_bits"], health["max_batch"], health["batching"]) == (8, 2, False)
        tok = engine.pipeline.tokenizer
        ids = encode_messages(tok, messages)
        want = detok(tok, quantized_plain(target, ids, 12, 8))
        assert len(want) > 5
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for cached in (False, True):
            r = oai.chat.completions.create(
                model="qwen3_next",
                messages=messages,
                max_tokens=12,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].message.content == want
            hit = r.usage.prompt_tokens_details.cached_tokens
            assert hit == (r.usage.prompt_tokens if cached else 0)
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        m = claude.messages.create(model="qwen3_next", messages=messages, max_tokens=12,
                                   extra_body={"ignore_eos": True})  # fmt: skip
        assert m.content[0].text == want


def test_serve_says_when_max_batch_cannot_batch(kinds):
    """`serve --max-batch 4 --kv-bits 8` says at start-up that requests are served one at a
    time, and why; a target that batches says nothing."""
    from outrider.server.command import batching_note

    target, _ = kinds["qwen3_next"]
    quantized = outrider.load(str(target), mode="lookup", kv_bits=8)
    note = batching_note(quantized, 4)
    assert note is not None and "one at a time" in note and "--kv-bits" in note
    assert batching_note(quantized, 1) is None
    plain = outrider.load(str(target), mode="lookup")
    assert plain.target.batches and batching_note(plain, 4) is None
