"""Verify forwards padded to a cheaper width (`Target.forward`): the default of
core/device.py's `verify_pad`, and the padding a calibration measures (`Calibration.padding`).

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
from outrider.core import calibration
from outrider.core.calibration import Calibration
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
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")  # the few-row kernel: nothing to pad for
    assert verify_pad(quantized) == 0
    monkeypatch.setenv("OUTRIDER_MATMUL", "fast")
    with pytest.raises(OutriderError, match="OUTRIDER_MATMUL must be auto, native or rows"):
        verify_pad(quantized)


def test_a_padded_forward_returns_the_real_rows_and_keeps_only_them(qwen3_target):
    target = outrider.load(str(qwen3_target), mode="baseline").target
    prompt = list(range(3, 20))
    ids = mx.array([40, 41, 42, 43, 44], dtype=mx.uint32)
    taps = (0, 2)
    target.install_taps(taps)
    results = {}
    for pad in (0, 8):
        target.pad_verifies(pad)
        cache = target.make_cache()
        target.prefill(prompt, cache)
        logits, tapped = target.forward(ids, cache, taps)
        mx.eval(logits, tapped)
        results[pad] = (logits, tapped, cache[0].offset)
    target.pad_verifies(0)
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
    pipe.target.pad_verifies(8)
    for cap in (1, 4):
        for i, prompt in enumerate(PROMPTS[:2]):
            ids = pipe.encode(prompt)
            want = plain_greedy(qwen3_target, ids, 40)
            got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
            assert got.tokens == want, f"{mode} cap {cap} diverged on prompt {i}"


def curve_calibration(curve: list[float]) -> Calibration:
    return Calibration(key={}, verify_ms={128: curve, 1024: [2 * c for c in curve]})


def test_the_calibration_pads_where_a_wider_forward_costs_less():
    # the H200's shape for a quantized target: 2-7 rows dear, 8 rows about one row's cost
    cal = curve_calibration([1.0, 1.6, 2.0, 2.4, 3.0, 3.3, 3.6, 1.1, 1.9])
    assert cal.padding() == {n: 8 for n in range(2, 8)}
    cal.widths = cal.padding()
    assert cal.verify_cost(5) == cal.verify_cost(8) == pytest.approx(1.1e-3)
    assert cal.verify_cost(9) == pytest.approx(1.9e-3)
    assert cal.batch_verify_cost(1, 5) == pytest.approx(3.0e-3)  # a batch is not padded
    assert curve_calibration([1.0, 1.2, 1.4, 1.6, 1.8]).padding() == {}  # a CPU's curve
    assert curve_calibration([1.0, 1.5, 1.45, 1.6]).padding() == {}  # within the noise


def test_measuring_sees_the_unpadded_forward_and_keeps_the_padding(qwen3_target, drafters):
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    target = pipe.target
    target.pad_verifies(8)
    seen, forward = [], target.forward

    def spy(*args, **kwargs):
        seen.append(dict(target.verify_widths))
        return forward(*args, **kwargs)

    target.forward = spy
    cal = calibration.measure(pipe, contexts=(16,), max_width=4, repeats=1)
    del target.forward
    assert len(cal.verify_ms[16]) == 4
    assert seen and all(s == {} for s in seen[: 4 * 2]), "the curve was measured padded"
    assert target.verify_widths == {n: 8 for n in range(2, 8)}


def test_a_stored_calibration_decides_the_padding(qwen3_target, drafters):
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    assert pipe.target.verify_widths == {}  # the CPU pads by default nowhere
    cal = curve_calibration([1.0, 1.6, 2.0, 2.4, 3.0, 3.3, 3.6, 1.1, 1.9])
    cal.key = calibration.calibration_key(pipe)
    calibration.save(cal)
    again = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    assert again.target.verify_widths == {n: 8 for n in range(2, 8)}
    assert again.calibration.summary()["padding"] == {str(n): 8 for n in range(2, 8)}
    ids = again.encode(PROMPTS[1])
    got = again.generate(ids, max_tokens=40, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 40)


def test_native_turns_measured_padding_off_too(qwen3_target, drafters, monkeypatch):
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    cal = curve_calibration([1.0, 1.6, 2.0, 2.4, 3.0, 3.3, 3.6, 1.1, 1.9])
    cal.key = calibration.calibration_key(pipe)
    calibration.save(cal)
    monkeypatch.setenv("OUTRIDER_MATMUL", "native")
    again = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    assert again.target.verify_widths == {}


def test_pipelines_sharing_a_target_share_its_first_calibrated_padding(qwen3_target, drafters):
    """A benchmark puts every mode on one target: the first calibration applied decides the
    padding it runs, and a later pipeline's calibration reads its costs at those widths (two
    measurements of one curve can differ by noise; the target runs only one padding)."""
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    first = curve_calibration([1.0, 1.6, 2.0, 2.4, 3.0, 3.3, 3.6, 1.1, 1.9])
    first.pad(pipe.target)
    assert pipe.target.verify_widths == {n: 8 for n in range(2, 8)}
    other = curve_calibration([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6])  # pads nothing
    other.pad(pipe.target)
    assert pipe.target.verify_widths == {n: 8 for n in range(2, 8)}
    assert other.widths == pipe.target.verify_widths
    assert other.verify_cost(5) == pytest.approx(2.4e-3)  # read at width 8, which runs
