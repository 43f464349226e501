"""`GET /machine`: this machine's chip, memory and bandwidth, and the loaded model's
roofline: how fast plain decoding could go here and how close its measured step comes
(core/roofline.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from fastapi import APIRouter

from ..core import fit
from ..core.roofline import Roofline, device_name, kv_bytes_per_token, peak_bandwidth
from .engine import model_id


def report(state: Any) -> dict[str, Any]:
    engine = state.engine
    pipe = engine.pipeline
    peak, source = peak_bandwidth()
    total, where = fit.machine_memory()
    out: dict[str, Any] = {
        "chip": {"name": device_name() or None, "device": str(mx.default_device())},
        "bandwidth": {"gb_s": peak, "source": source},
        "memory": {
            "total_bytes": total,
            "total_source": where,
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
        },
        "model": None,
        "roofline": None,
        "baseline": None,
        "verdict": None,
    }
    if pipe is None:
        return out
    target = pipe.target
    roof = roofline(target, peak, source)
    window = engine.context_window
    out["model"] = {
        "target": model_id(pipe),
        "mode": pipe.mode,
        "target_weight_bytes": roof.weights,
        "kv_bytes_per_token": roof.kv_per_token,
        "context_window": window,
    }
    ceiling = lambda n: None if roof.ceiling(n) is None else round(roof.ceiling(n), 1)  # noqa: E731
    out["roofline"] = {
        "tokens_per_sec_at_zero": ceiling(0),
        "tokens_per_sec_at_context_window": ceiling(window) if window else None,
    }
    step_ms, context = _plain_step(pipe)
    if step_ms is not None:
        out["baseline"] = {
            "step_ms": round(step_ms, 4),
            "context": context,
            "achieved_gb_s": round(roof.achieved_gb_s(step_ms, context), 4),
            "ceiling_tokens_per_sec": ceiling(context),
            "tokens_per_sec": round(1e3 / step_ms, 1),
        }
    out["verdict"] = roof.verdict(step_ms, context)
    return out


def roofline(target: Any, peak: float | None, source: str) -> Roofline:
    """The loaded target's roofline at peak bandwidth `peak` (GB/s)."""
    return Roofline(
        peak, source, target.weight_bytes, kv_bytes_per_token(target.config, target.kv_bits)
    )


def host_bound(pipe: Any) -> dict[str, Any] | None:
    """The roofline's verdict where it is `structural` (a calibrated plain step far below
    the bandwidth ceiling), else None: /health warns about it (server/warnings.py)."""
    peak, source = peak_bandwidth()
    step_ms, context = _plain_step(pipe)
    if peak is None or step_ms is None:
        return None
    verdict = roofline(pipe.target, peak, source).verdict(step_ms, context)
    return verdict if verdict["level"] == "structural" else None


def _plain_step(pipe: Any) -> tuple[float | None, int]:
    """(ms, context) of one plain step at the shortest context calibration timed it at, or
    (None, 0) where this pipeline has no calibration."""
    cal = getattr(pipe, "calibration", None)
    steps = getattr(cal, "plain_ms", None) or {}
    if not steps:
        return None, 0
    context = min(steps)
    return float(steps[context]), int(context)


def router(state: Any) -> APIRouter:
    r = APIRouter()

    @r.get("/machine")
    def machine() -> dict:
        return report(state)

    return r
