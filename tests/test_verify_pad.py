"""Verify forwards padded to a cheaper width (core/device.py `verify_pad`, Target.forward).

On MLX's CUDA backend a quantized target's 8-row matmuls cost about what one row costs, so a
narrower verify runs padded to 8 rows there. The CPU never pads by default; these tests force
the padding to check that it changes nothing a caller can see: the logits and taps of the
real rows, the cache after the forward, and every mode's greedy output.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core.device import on_cuda_gpu, verify_pad
from outrider.core.errors import OutriderError
from outrider.testing import build_model, tiny_config


def test_the_cpu_does_not_pad_and_the_setting_is_checked(monkeypatch):
    quantized = build_model(tiny_config("qwen3"), seed=1)
    nn.quantize(quantized, group_size=64, bits=4)
    plain = build_model(tiny_config("qwen3"), seed=1)
    assert verify_pad(plain) == 0
    assert verify_pad(quantized) == (8 if on_cuda_gpu() else 0)
    monkeypatch.setenv("OUTRIDER_MATMUL", "native")
    assert verify_pad(quantized) == 0
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")
    with pytest.raises(OutriderError, match="OUTRIDER_MATMUL must be auto or native"):
        verify_pad(quantized)


def test_a_padded_forward_returns_the_real_rows_and_keeps_only_them(qwen3_target):
    target = outrider.load(str(qwen3_target), mode="baseline").target
    prompt = list(range(3, 20))
    ids = mx.array([40, 41, 42, 43, 44], dtype=mx.uint32)
    taps = (0, 2)
    target.install_taps(taps)
    results = {}
    for pad in (0, 8):
        target.verify_pad = pad
        cache = target.make_cache()
        target.prefill(prompt, cache)
        logits, tapped = target.forward(ids, cache, taps)
        mx.eval(logits, tapped)
        results[pad] = (logits, tapped, cache[0].offset)
    target.verify_pad = 0
    (l0, t0, off0), (l8, t8, off8) = results[0], results[8]
    assert l8.shape == l0.shape and t8.shape == t0.shape
    assert off8 == off0 == len(prompt) + 5
    assert mx.allclose(l8, l0, rtol=1e-5, atol=1e-5).item()
    assert mx.allclose(t8, t0, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("mode,drafter", [("dspark", "dspark"), ("lookup", None)])
def test_padded_verifies_keep_greedy_output(qwen3_target, drafters, mode, drafter):
    pipe = outrider.load(
        str(qwen3_target), None if drafter is None else str(drafters[drafter]), mode=mode
    )
    pipe.target.verify_pad = 8
    for cap in (1, 4):
        for i, prompt in enumerate(PROMPTS[:2]):
            ids = pipe.encode(prompt)
            want = plain_greedy(qwen3_target, ids, 40)
            got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
            assert got.tokens == want, f"{mode} cap {cap} diverged on prompt {i}"
