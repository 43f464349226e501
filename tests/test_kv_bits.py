"""A quantized KV cache (`kv_bits`) changes what the target computes, never what speculation
adds: every mode's greedy output equals mlx-lm's plain decoding over the same quantized cache.

The reference is mlx-lm's `generate_step` given quantized caches from the first prompt token on
(what outrider keeps): mlx-lm's `QuantizedKVCache`, or where the target hands attention copied
heads (`ContiguousQuantizedKVCache`, for MLX's CUDA backend), that one; a separate test shows the
copied heads attend exactly as mlx-lm's grouped-query attention does. Verify forwards read the
same quantized keys one-row decoding reads, so the tokens are compared exactly; a batched or GPU
run may part from it only at an fp tie, which benchmarks check with their tie rule.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, _load_plain, load_kv_bits, plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import outrider
from outrider.core.errors import OutriderError, UnsupportedTargetError
from outrider.core.target import ContiguousQuantizedKVCache
from outrider.testing import make_tiny_drafter, make_tiny_target

_QUANTIZED_RUNS: dict[tuple, list[int]] = {}


def quantized_plain(model_path, ids: list[int], n: int, bits: int, repeats=None) -> list[int]:
    """mlx-lm's plain greedy decoding over `bits`-bit quantized caches (mlx-lm's own, or with
    each head copied out `repeats` times over), made once per model, prompt, length, bits and
    repeats (every mode of a test compares against the same one)."""
    run = (str(model_path), tuple(ids), n, bits, repeats)
    if run not in _QUANTIZED_RUNS:
        model = _load_plain(str(model_path))
        _QUANTIZED_RUNS[run] = greedy(model, ids, n, lambda: quantized_cache(bits, repeats))
    return list(_QUANTIZED_RUNS[run])


def quantized_cache(bits: int, repeats=None):
    if repeats is None:
        return QuantizedKVCache(group_size=64, bits=bits)
    return ContiguousQuantizedKVCache(64, bits, repeats)


def greedy(model, ids: list[int], n: int, make) -> list[int]:
    cache = [make() for _ in model.layers]
    steps = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache)
    return [int(tok) for tok, _ in steps]


def one_kv_head_per_query_head(model) -> None:
    """Make a grouped-query model compute the same attention with as many KV heads as query
    heads: each KV head's rows of k_proj and v_proj (and bias) repeated for every query head
    of its group. mlx-lm then attends without broadcasting keys, on every device."""
    for layer in model.layers:
        attn = layer.self_attn
        group = attn.n_heads // attn.n_kv_heads
        for proj in (attn.k_proj, attn.v_proj):
            for name in ("weight", "bias"):
                if name in proj:
                    a = proj[name]
                    heads = a.reshape(attn.n_kv_heads, -1, *a.shape[1:])
                    proj[name] = mx.repeat(heads, group, axis=0).reshape(-1, *a.shape[1:])
        attn.n_kv_heads = attn.n_heads


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
        pytest.skip("MLX on this device cannot attend over a float32 quantized cache")
    return wide_heads


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mode", ["dspark", "lookup", "baseline"])
def test_every_mode_matches_plain_decoding_over_the_same_quantized_cache(kv_heads, bits, mode):
    target, drafter = kv_heads
    pipe = outrider.load(str(target), str(drafter) if mode == "dspark" else None, mode=mode,
                         kv_bits=bits)  # fmt: skip
    assert sum(isinstance(c, QuantizedKVCache) for c in pipe.target.make_cache()) > 0
    repeats = pipe.target.kv_repeats
    for prompt in PROMPTS[:2]:
        ids = pipe.encode(prompt)
        got = pipe.generate(ids, max_tokens=32, stop_tokens=set()).tokens
        assert got == quantized_plain(target, ids, 32, bits, repeats)


def test_copied_heads_attend_as_grouped_query_attention(wide_heads):
    """A `ContiguousQuantizedKVCache` changes how attention is run, never what it computes: the
    grouped-query model over copied heads decodes what the same model with one KV head per
    query head decodes over copied heads of its own (no broadcast on either side), and, where
    MLX runs mlx-lm's own cache, what that decodes for either model."""
    target, _ = wide_heads
    ids = list(range(5, 40))
    copied = quantized_plain(target, ids, 48, 4, repeats=2)
    twin = _load_plain(str(target))
    one_kv_head_per_query_head(twin)
    assert copied == greedy(twin, ids, 48, lambda: quantized_cache(4, repeats=1))
    pipe = load_kv_bits(target, 4, mode="baseline")
    if pipe is not None and pipe.target.kv_repeats is None:  # MLX runs mlx-lm's cache here
        assert copied == quantized_plain(target, ids, 48, 4)
        assert copied == greedy(twin, ids, 48, lambda: quantized_cache(4))


def test_forced_copied_heads_decode_as_plain_decoding(wide_heads):
    """DSpark over a target forced to hand attention copied heads equals mlx-lm's plain
    decoding over the same cache; the heads are stored once (trim and snapshots unchanged)."""
    target, drafter = wide_heads
    pipe = outrider.load(str(target), str(drafter), mode="dspark")
    pipe.target.quantize_kv(4, copy_heads=True)
    assert (pipe.target.kv_bits, pipe.target.kv_repeats) == (4, 2)
    cache = pipe.target.make_cache()
    assert all(isinstance(c, ContiguousQuantizedKVCache) for c in cache)
    pipe.target.forward(mx.array([1, 2, 3], dtype=mx.uint32), cache)
    assert cache[0].keys[0].shape[1] == 1  # one stored KV head, as the model computes it
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=32, stop_tokens=set()).tokens
    assert got == quantized_plain(target, ids, 32, 4, repeats=2)


def test_quantized_kv_changes_the_target_computation(kv_heads):
    """The flag takes effect: 4-bit keys change a random-weight model's greedy path, and the
    pipeline follows the quantized one."""
    target, _ = kv_heads
    pipe = outrider.load(str(target), mode="baseline", kv_bits=4)
    ids = pipe.encode(PROMPTS[0])
    quantized = quantized_plain(target, ids, 48, 4, pipe.target.kv_repeats)
    assert quantized != plain_greedy(target, ids, 48)
    assert pipe.generate(ids, max_tokens=48, stop_tokens=set()).tokens == quantized


def test_bad_kv_bits_are_refused(qwen3_target):
    with pytest.raises(OutriderError, match="--kv-bits must be 8 or 4"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=3)
    with pytest.raises(UnsupportedTargetError, match="head dimension divisible by 64"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=8)  # head dim 16


@pytest.mark.parametrize("kernel", ["raises", "is wrong"])
def test_a_device_without_a_broadcast_kernel_gets_copied_heads(wide_heads, monkeypatch, kernel):
    """Where MLX's product over mlx-lm's broadcast of grouped KV heads raises (MLX 0.32's CUDA
    backend) or computes wrong values without raising, the load check falls back to copied
    heads, and decoding equals mlx-lm's decoding over them computed before the kernel was
    broken."""
    target, _ = wide_heads
    ids = list(range(5, 30))
    reference = quantized_plain(target, ids, 24, 4, repeats=2)
    real = mx.quantized_matmul

    def broken_broadcast(x, w, *args, **kwargs):
        if w.ndim == 5:  # keys expanded to (B, kv heads, 1, positions, packed)
            if kernel == "raises":
                raise RuntimeError("[quantized_matmul] No implementation for problem shape")
            return 3 * real(x, w, *args, **kwargs)
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", broken_broadcast)  # mlx-lm's attention calls it
    pipe = outrider.load(str(target), mode="baseline", kv_bits=4)
    assert pipe.target.kv_repeats == 2
    assert pipe.generate(ids, max_tokens=24, stop_tokens=set()).tokens == reference


def test_a_device_that_cannot_attend_over_a_quantized_cache_refuses_kv_bits(
    wide_heads, monkeypatch
):
    """Where MLX has no kernel for the quantized attention at all, over mlx-lm's cache or
    copied heads, --kv-bits is refused at load with one line naming MLX's error, not in the
    middle of a generation; forcing mlx-lm's cache where only copied heads run is refused the
    same way."""
    target, _ = wide_heads

    def no_kernel(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 3x3x64x2")

    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)  # what mlx-lm's attention calls
    with pytest.raises(UnsupportedTargetError) as refused:
        outrider.load(str(target), mode="baseline", kv_bits=4)
    assert "No implementation for problem shape" in str(refused.value)
    assert "run without --kv-bits" in str(refused.value)
    monkeypatch.undo()
    pipe = load_kv_bits(target, 4, mode="baseline")
    if pipe is None:  # this device has no such kernel at all: the same refusal, unforced
        with pytest.raises(UnsupportedTargetError, match="run without --kv-bits"):
            outrider.load(str(target), mode="baseline", kv_bits=4)
        return
    assert pipe.target.kv_bits == 4
    if pipe.target.kv_repeats is not None:  # mlx-lm's cache fails here: forcing it is refused
        with pytest.raises(UnsupportedTargetError, match="run without --kv-bits"):
            pipe.target.quantize_kv(4, copy_heads=False)
