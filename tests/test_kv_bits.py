"""A quantized KV cache (`kv_bits`) changes what the target computes, never what speculation
adds: every mode's greedy output equals mlx-lm's plain decoding over the same quantized cache.

The reference is mlx-lm's `generate_step` given `QuantizedKVCache`s from the first prompt token
on (what outrider keeps). Verify forwards read the same quantized keys one-row decoding reads,
so on the CPU the tokens are compared exactly; a batched or GPU run may part from it only at an
fp tie, which benchmarks check with their tie rule.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, _load_plain, load_kv_bits, plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import outrider
import outrider.core.target as target_module
from outrider import doctor
from outrider.core import device
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import OutriderError, UnsupportedTargetError
from outrider.testing import make_tiny_drafter, make_tiny_target

_QUANTIZED_RUNS: dict[tuple, list[int]] = {}


def quantized_plain(model_path, ids: list[int], n: int, bits: int) -> list[int]:
    """mlx-lm's plain greedy decoding over `bits`-bit quantized caches, made once per model,
    prompt, length and bits (every mode of a test compares against the same one)."""
    run = (str(model_path), tuple(ids), n, bits)
    if run not in _QUANTIZED_RUNS:
        model = _load_plain(str(model_path))
        cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
        out = []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache):
            out.append(int(tok))
        _QUANTIZED_RUNS[run] = out
    return list(_QUANTIZED_RUNS[run])


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
    assert sum(isinstance(c, QuantizedKVCache) for c in pipe.target.make_cache()) > 0
    for prompt in PROMPTS[:2]:
        ids = pipe.encode(prompt)
        got = pipe.generate(ids, max_tokens=32, stop_tokens=set()).tokens
        assert got == quantized_plain(target, ids, 32, bits)


def test_quantized_kv_changes_the_target_computation(kv_heads):
    """The flag takes effect: 4-bit keys change a random-weight model's greedy path, and the
    pipeline follows the quantized one."""
    target, _ = kv_heads
    pipe = outrider.load(str(target), mode="baseline", kv_bits=4)
    ids = pipe.encode(PROMPTS[0])
    quantized = quantized_plain(target, ids, 48, 4)
    assert quantized != plain_greedy(target, ids, 48)
    assert pipe.generate(ids, max_tokens=48, stop_tokens=set()).tokens == quantized


def test_bad_kv_bits_are_refused(qwen3_target):
    with pytest.raises(OutriderError, match="--kv-bits must be 8 or 4"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=3)
    with pytest.raises(UnsupportedTargetError, match="head dimension divisible by 64"):
        outrider.load(str(qwen3_target), mode="baseline", kv_bits=8)  # head dim 16


def test_a_device_that_cannot_attend_over_a_quantized_cache_refuses_kv_bits(
    wide_heads, monkeypatch
):
    """Where MLX has no kernel for the quantized attention (MLX 0.32's CUDA backend for the
    cache as mlx-lm hands it over), --kv-bits is refused at load with one line naming MLX's
    error, not in the middle of a generation."""
    target, _ = wide_heads

    def no_kernel(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 3x3x64x2")

    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)  # what mlx-lm's attention calls
    monkeypatch.setattr(target_module, "quantized_attention_refusal", lambda: None)
    with pytest.raises(UnsupportedTargetError) as refused:
        outrider.load(str(target), mode="baseline", kv_bits=4)
    assert "No implementation for problem shape" in str(refused.value)
    assert "run without --kv-bits" in str(refused.value)
    monkeypatch.undo()
    pipe = load_kv_bits(target, 4, mode="baseline")
    if pipe is not None:  # MLX's own kernels: the flag is taken
        assert pipe.target.kv_bits == 4
    else:  # this device has no such kernel (MLX 0.32 on CUDA): the same refusal, unforced
        with pytest.raises(UnsupportedTargetError, match="run without --kv-bits"):
            outrider.load(str(target), mode="baseline", kv_bits=4)


def test_kv_bits_is_refused_on_a_cuda_gpu(wide_heads, monkeypatch):
    """MLX 0.32's CUDA backend decoded wrong tokens over a quantized cache at shapes a load
    check does not reach (docs/testing-on-gpu.md), so a CUDA GPU refuses the flag by name, and
    `outrider doctor` says so."""
    monkeypatch.setattr(device, "on_cuda_gpu", lambda: True)
    reason = device.quantized_attention_refusal()
    assert reason is not None and "CUDA backend" in reason
    assert doctor.doctor_report()["kv_bits"] == f"refused here: {reason}"
    monkeypatch.undo()
    monkeypatch.setattr(target_module, "quantized_attention_refusal", lambda: reason)
    with pytest.raises(UnsupportedTargetError, match="CUDA backend .* wrongly"):
        outrider.load(str(wide_heads[0]), mode="baseline", kv_bits=4)
    if not on_cuda_gpu():
        assert doctor.doctor_report()["kv_bits"] == "8, 4"
