"""How fast plain decoding could go on this machine, and how close it comes.

One plain step reads every weight once and the KV cache up to the current context, so memory
bandwidth bounds its speed: tokens/s ≤ bandwidth / (weight bytes + KV bytes per token ×
context). That ceiling, against the step time calibration measured (core/calibration.py),
gives the model bandwidth utilisation (MBU): near 1, plain decoding is memory-bound and
speculation's rounds read the weights once for several tokens; far below, something else
bounds each step (the host's work per forward on a small model, arithmetic on a CPU), and a
round's extra rows cost more than the bandwidth alone says.

Peak bandwidth comes from the vendors' published figures for the chips below (matched on
MLX's device name), or from OUTRIDER_BANDWIDTH_GBS; elsewhere it is unknown and MBU is not
given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

BANDWIDTH_ENV = "OUTRIDER_BANDWIDTH_GBS"

# Peak memory bandwidth, GB/s, from the vendors' specifications (NVIDIA's data sheets; Apple's
# chip pages). Longer names first: the first name contained in the device's name wins.
BANDWIDTH_GB_S: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, HBM3
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("RTX 4090", 1008.0),
    ("RTX 5090", 1792.0),
    ("M1 Ultra", 800.0),
    ("M1 Max", 400.0),
    ("M1 Pro", 200.0),
    ("M1", 68.25),
    ("M2 Ultra", 800.0),
    ("M2 Max", 400.0),
    ("M2 Pro", 200.0),
    ("M2", 100.0),
    ("M3 Ultra", 819.0),
    ("M3 Max", 400.0),
    ("M3 Pro", 150.0),
    ("M3", 100.0),
    ("M4 Max", 546.0),
    ("M4 Pro", 273.0),
    ("M4", 120.0),
)

HEALTHY, OK = 0.75, 0.5  # MBU bands: memory-bound, partly, something else bounds each step


def device_name() -> str:
    """MLX's name for the default device (a GPU's product name, an Apple chip's), or ""."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX build without it
        return ""
    return str(info.get("device_name") or info.get("architecture") or "")


def peak_bandwidth(name: str | None = None) -> tuple[float | None, str]:
    """(GB/s, where it came from: "env", "spec" or "unknown") for the default device."""
    given = os.environ.get(BANDWIDTH_ENV, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = 0.0
        if value > 0:
            return value, "env"
    name = device_name() if name is None else name
    for part, gb_s in BANDWIDTH_GB_S:
        if part.lower() in name.lower():
            return gb_s, "spec"
    return None, "unknown"


def weight_bytes(model: Any) -> int:
    """Bytes of a loaded model's parameters as they sit in memory (quantized ones packed)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))


@dataclass
class Roofline:
    """Plain decoding's memory ceiling for one model on one machine."""

    bandwidth_gb_s: float | None
    source: str
    weights: int  # bytes read once a step (target and drafter alike for a plain step: target)
    kv_per_token: int  # bytes of KV cache a step reads per token of context

    def ceiling(self, context: int) -> float | None:
        """Tokens/s if a step cost only its reading, at `context` tokens of cache."""
        if not self.bandwidth_gb_s:
            return None
        return self.bandwidth_gb_s * 1e9 / (self.weights + self.kv_per_token * context)

    def achieved_gb_s(self, step_ms: float, context: int) -> float:
        """GB/s a step of `step_ms` read at `context`."""
        return (self.weights + self.kv_per_token * context) / (step_ms * 1e-3) / 1e9

    def verdict(self, step_ms: float | None, context: int) -> dict[str, Any]:
        """{level, headline, mbu}: how close a measured plain step came to the ceiling."""
        if step_ms is None:
            return {"level": "unmeasured", "mbu": None,
                    "headline": "no calibration yet: run `outrider calibrate` or a "
                    "`--max-draft auto` generation to time a plain step"}  # fmt: skip
        achieved = self.achieved_gb_s(step_ms, context)
        if not self.bandwidth_gb_s:
            return {"level": "unknown_peak", "mbu": None,
                    "headline": f"plain decoding reads {achieved:.1f} GB/s; this device's peak "
                    f"bandwidth is unknown (set {BANDWIDTH_ENV})"}  # fmt: skip
        mbu = achieved / self.bandwidth_gb_s
        if mbu >= HEALTHY:
            level, says = (
                "healthy",
                "memory-bound: a round reads the weights once for all its tokens",
            )
        elif mbu >= OK:
            level, says = "ok", "partly memory-bound"
        else:
            level, says = (
                "structural",
                (
                    "something other than reading weights bounds each step (the host's work per "
                    "forward on a small model, or arithmetic): a round's extra rows cost more "
                    "than bandwidth alone says"
                ),
            )
        headline = (
            f"plain decoding reads {achieved:.1f} of {self.bandwidth_gb_s:.0f} GB/s "
            f"(MBU {mbu:.2f}): {says}"
        )
        return {"level": level, "mbu": round(mbu, 4), "headline": headline}


def kv_bytes_per_token(config: dict[str, Any], kv_bits: int | None = None) -> int:
    """Bytes one token of context adds to the KV cache (0 where the config says nothing)."""
    from .fit import kv_cache_bytes

    try:
        return int(kv_cache_bytes(config, window=1, kv_bits=kv_bits) or 0)
    except Exception:  # a config fit.py cannot read: the weights alone bound the step
        return 0
