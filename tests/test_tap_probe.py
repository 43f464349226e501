"""The tap probe: a tapped forward that changes the logits is refused; rounding noise is not.

On CUDA the tapped forward may run another attention kernel than the model's own (split,
padded), so its logits differ by rounding (SmolLM2: 0.0019 on logits of ~20). The probe's
tolerance is relative to the logits' scale; a real change is far larger."""

from __future__ import annotations

import mlx.core as mx
import pytest

from outrider.core.errors import UnsupportedTargetError
from outrider.core.plugins import Plugins
from outrider.core.target import Target
from outrider.loaders import load_target


def _shifted_forward(monkeypatch, shift) -> None:
    forward = Target.forward

    def shifted(self, ids, cache, tap_ids=()):
        logits, taps = forward(self, ids, cache, tap_ids)
        return logits + shift(logits), taps

    monkeypatch.setattr(Target, "forward", shifted)


def test_rounding_noise_at_the_logits_scale_is_accepted(monkeypatch, qwen3_target) -> None:
    target = load_target(Plugins(), str(qwen3_target))
    # 2e-4 of the largest logit: above the old absolute 1e-3 once logits exceed 5
    _shifted_forward(monkeypatch, lambda z: 2e-4 * mx.abs(z).max() * mx.sign(z))
    target.install_taps((0, 1))
    assert {0, 1} <= target._probed


def test_a_tap_that_changes_the_logits_is_refused(monkeypatch, qwen3_target) -> None:
    target = load_target(Plugins(), str(qwen3_target))
    _shifted_forward(monkeypatch, lambda z: 0.05 * mx.abs(z).max() * mx.sign(z))
    with pytest.raises(UnsupportedTargetError, match="hidden-state taps do not work"):
        target.install_taps((0, 1))
