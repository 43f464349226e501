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
from conftest import PROMPTS, _load_plain, fp32_close, load_kv_bits, plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_batch import uneven_rounds

import outrider
from outrider import doctor
from outrider.core import device
from outrider.core.device import KV_ATTENTION_ENV, kv_attention
from outrider.core.errors import OutriderError, UnsupportedTargetError
from outrider.core.kv_quant import DequantizingKVCache, quantized_kv, stored_quantized
from outrider.plugins.targets.batched import QuantizedProductRows, QuantizedRows
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
    same quantized caches, a repeat is a whole-prompt hit with the same answer, and concurrent
    requests of both APIs share rounds and each still get their own answer."""
    import asyncio

    import anthropic
    import openai
    import requests
    from live_server import detok, live_server
    from test_server_batching import metric

    from outrider.core.prefix_cache import PrefixCache
    from outrider.prompts import encode_messages
    from outrider.server.engine import LoadSpec

    target, drafter = kinds["qwen3_next"]
    spec = LoadSpec(str(target), str(drafter), mode="dspark", kv_bits=8)
    asks = [[{"role": "user", "content": f"Say something about the {w}."}]
            for w in ("sea", "sky", "hills", "rain")]  # fmt: skip
    with live_server(spec, max_batch=2) as (url, engine):
        engine.set_prefix_cache(PrefixCache(1 << 30))
        health = requests.get(url + "/health").json()
        assert (health["kv_bits"], health["max_batch"], health["batching"]) == (8, 2, True)
        tok = engine.pipeline.tokenizer
        want = [detok(tok, quantized_plain(target, encode_messages(tok, m), 12, 8)) for m in asks]
        assert all(len(w) > 5 for w in want)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for cached in (False, True):
            r = oai.chat.completions.create(
                model="qwen3_next",
                messages=asks[0],
                max_tokens=12,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].message.content == want[0]
            hit = r.usage.prompt_tokens_details.cached_tokens
            assert hit == (r.usage.prompt_tokens if cached else 0)
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        m = claude.messages.create(model="qwen3_next", messages=asks[0], max_tokens=12,
                                   extra_body={"ignore_eos": True})  # fmt: skip
        assert m.content[0].text == want[0]

        async def together() -> list[str]:
            a_oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            a_claude = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)

            async def by_openai(messages) -> str:
                r = await a_oai.chat.completions.create(model="qwen3_next", messages=messages,
                    max_tokens=12, extra_body={"ignore_eos": True})  # fmt: skip
                return r.choices[0].message.content

            async def by_anthropic(messages) -> str:
                r = await a_claude.messages.create(model="qwen3_next", messages=messages,
                    max_tokens=12, extra_body={"ignore_eos": True})  # fmt: skip
                return r.content[0].text

            calls = [by_openai(asks[1]), by_anthropic(asks[2]), by_openai(asks[3])]
            return await asyncio.gather(*calls)

        assert asyncio.run(together()) == want[1:]
        assert metric(url, "outrider_batch_rows_max") > 1  # quantized rows shared rounds


def test_serve_batches_quantized_targets_and_says_when_it_cannot(kinds, tmp_path):
    """`--kv-bits` targets batch, so `serve --max-batch 4 --kv-bits 8` says nothing; a family
    that cannot batch says at start-up that requests are served one at a time, and why."""
    from outrider.server.command import batching_note

    target, _ = kinds["qwen3_next"]
    quantized = outrider.load(str(target), mode="lookup", kv_bits=8)
    assert quantized.target.batches and batching_note(quantized, 4) is None
    # cohere2 has no family plugin: the mlx-lm fallback runs it, one row at a time
    other = make_tiny_target(tmp_path / "c2", family="llama", model_type="cohere2",
                             head_dim=16, sliding_window=8, sliding_window_pattern=2)  # fmt: skip
    plain = outrider.load(str(other), mode="baseline")
    note = batching_note(plain, 4)
    assert note is not None and "one at a time" in note
    assert batching_note(plain, 1) is None


def quantized_step(cache) -> float:
    """The largest quantization step (scale) among the stored keys of a one-row cache."""
    return max(mx.abs(stored_quantized(c).keys[1]).max().item() for c in quantized_layers(cache))


def dense_keys(c) -> mx.array:
    q = stored_quantized(c)
    parts = [a[..., : q.offset, :] for a in q.keys]
    return mx.dequantize(*parts, group_size=q.group_size, bits=q.bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_quantized_rows_hold_what_each_row_holds_alone(kv_heads, bits):
    """Rounds of random widths over a batch of quantized rows, each row rejecting its own count
    (so rows move their oldest columns into their rejected slots in all three stored arrays), a
    row leaving and one joining: every round's logits are each row's alone, and a row taken out
    holds its tokens in order, as a one-row quantized cache fed them holds them (to one
    quantization step, where float rounding of a batched product flips a code)."""
    target = outrider.load(str(kv_heads[0]), mode="baseline", kv_bits=bits).target

    def close(batched: mx.array, alone: mx.array) -> bool:
        # Float rounding of batched products. On a GPU a batched product and a one-row one
        # sum in other orders even in full float32 (the suite turns TF32 off), and a key that
        # sits at a rounding boundary of its 8-bit code flips by one step: the H200 parted by
        # more than 1e-3 of the logits' scale in GPU runs 10 and 11 (2026-12-04). A row reading
        # another row's columns, or a column moved in one of the three arrays only, moves
        # logits by O(1) of their scale.
        scale = mx.abs(alone).max().item()
        if mx.default_device() == mx.gpu:
            return mx.abs(batched - alone).max().item() <= 5e-2 * scale
        return fp32_close(batched, alone, atol=1e-3 * scale)

    history, batched = uneven_rounds(target, [5, 9, 14], 8, 5, close)
    # read as a row alone reads: dequantized on a CUDA GPU, else MLX's quantized product
    kind = QuantizedRows if kv_attention() == "dequantized" else QuantizedProductRows
    assert [type(c) for c in batched] == [kind] * len(batched)
    for i, row in enumerate(history):
        mine = target.extract_row(batched, i)
        assert type(mine[0]) is type(target.make_cache()[0])  # the kind a row alone uses
        target.rollback(mine, 2)
        alone = target.make_cache()
        target.forward(mx.array(row[:-2], dtype=mx.uint32), alone)
        step = quantized_step(alone)
        for got, want in zip(mine, alone, strict=True):
            assert got.offset == want.offset == len(row) - 2
            assert mx.abs(dense_keys(got) - dense_keys(want)).max().item() <= step * 1.01


@pytest.mark.parametrize("family", ["dense", *KINDS])
def test_batched_requests_over_a_quantized_cache_equal_each_request_alone(kv_heads, kinds, family):
    """generate_batch with --kv-bits 8 on a dense, gated-delta, Mamba-2 and sliding-window
    target, rows joining as others finish: each row's greedy tokens are its single request's,
    in a drafting mode and in lookup."""
    target, drafter = kv_heads if family == "dense" else kinds[family]
    for mode in ("dspark", "lookup"):
        pipe = outrider.load(str(target), str(drafter) if mode == "dspark" else None,
                             mode=mode, kv_bits=8)  # fmt: skip
        assert pipe.target.batches
        rows = [pipe.encode(p) for p in PROMPTS[:3]]
        batch = pipe.generate_batch(rows, max_tokens=20, max_draft=4, stop_tokens=set(),
                                    max_batch=2)  # fmt: skip
        alone = [pipe.generate(r, max_tokens=20, max_draft=4, stop_tokens=set()).tokens
                 for r in rows]  # fmt: skip
        assert [r.tokens for r in batch] == alone, f"{family}: {mode}"


def test_the_disk_tier_keeps_quantized_entries_for_their_own_bits(kinds, tmp_path):
    """A `--prefix-cache-dir` entry of a `--kv-bits 8` gated-delta target survives a restart
    and restores its quantized layers (same tokens as a fresh run); the same model at 4 bits,
    a cache of another identity, never reads it (and leaves it to the 8-bit store)."""
    target, drafter = kinds["qwen3_next"]
    pipe = outrider.load(str(target), str(drafter), mode="dspark", kv_bits=8)
    fresh = outrider.load(str(target), str(drafter), mode="dspark", target=pipe.target)

    def run(p):
        return p.generate(FIRST, max_tokens=10, max_draft=4, stop_tokens=set())

    def restarted(p):
        p.enable_prefix_cache(gb=1, directory=tmp_path, interval=8)
        return run(p), p.prefix_cache.stats

    want = run(fresh).tokens
    restarted(pipe)
    got, stats = restarted(pipe)
    assert got.cached_tokens == len(FIRST) and got.tokens == want and stats["disk_hits"] == 1
    other = outrider.load(str(target), str(drafter), mode="dspark", kv_bits=4)
    alone = run(outrider.load(str(target), str(drafter), mode="dspark", target=other.target))
    got, stats = restarted(other)
    assert got.cached_tokens == 0 and stats["disk_hits"] == 0 and got.tokens == alone.tokens
    got, stats = restarted(pipe)
    assert got.cached_tokens == len(FIRST) and got.tokens == want and stats["disk_hits"] == 1


@pytest.mark.parametrize("batched", [False, True])
def test_half_precision_reads_of_a_dequantized_cache_take_outriders_attention(
    kv_heads, batched, monkeypatch
):
    """On a CUDA GPU a half-precision verify splits into one-row kernel calls and batched rows
    run as matmul attention (plugins/targets/verify_attention.py); over a dequantizing cache
    (one row, or a batch of them) they do too, over its dequantized keys, and give the model's
    own logits."""
    from test_split_attention import decoder_layers, wrapped_and_not

    from outrider.plugins.targets import verify_attention
    from outrider.testing import cast_model

    monkeypatch.setenv(KV_ATTENTION_ENV, "dequantized")
    target = outrider.load(str(kv_heads[0]), mode="baseline", kv_bits=8).target
    cast_model(target.model, mx.bfloat16)
    layers = decoder_layers(target)
    calls = []
    for name in ("matmul_attention", "chunked_causal_attention"):

        def heard(*args, _name=name, _own=getattr(verify_attention, name), **kwargs):
            calls.append(_name)
            return _own(*args, **kwargs)

        monkeypatch.setattr(verify_attention, name, heard)
    prompts = [list(range(5, 5 + n)) for n in (9, 23, 14)][: 3 if batched else 1]
    block = mx.array([[40 + r + c for c in range(5)] for r in range(len(prompts))], mx.uint32)
    (wrapped, heard), (own, unheard) = wrapped_and_not(target, layers, prompts, block, calls)
    kind = "matmul_attention" if batched else "chunked_causal_attention"
    assert heard == [kind] * len(layers) and unheard == []
    assert fp32_close(wrapped, own, atol=5e-2 * mx.abs(own).max().item())
