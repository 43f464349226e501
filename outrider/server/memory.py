"""The server's memory: a warning at load when the KV cache at the context window would not fit
(core/fit.py `load_warning`), and relief before a generation when memory runs short."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from ..core import fit
from ..core.prefix_cache import PrefixCache
from .metrics import Metrics

# The share of this machine's memory in use (core/fit.py `memory_in_use`) past which a
# generation first empties MLX's buffer cache, then the prefix cache (`relieve_memory`).
MEMORY_PRESSURE = 0.9


def fit_warning(spec: Any, window: int | None, rows: int) -> str | None:
    """`load_warning` for a loaded `LoadSpec` decoding `rows` requests together; None where it
    fits, nobody can tell, or the check itself failed (it is advice: a load never fails on it)."""
    try:
        return fit.load_warning(spec.model, spec.drafter, window=window, kv_bits=spec.kv_bits,
                            rows=rows)  # fmt: skip
    except Exception:
        return None


def _pressed() -> tuple[int, int] | None:
    """(in use, there are) when past MEMORY_PRESSURE, else None (a reading that fails too: it
    is no reason to fail a request)."""
    try:
        reading = fit.memory_in_use()
    except Exception:
        return None
    return reading if reading and reading[0] > MEMORY_PRESSURE * reading[1] else None


def guard_report(enabled: bool, metrics: Metrics) -> dict[str, Any]:
    """/health's `memory_guard`: whether it is on, its threshold, the share of memory in use
    now (None where it cannot be read), how often it emptied the prefix cache and when last."""
    try:
        reading = fit.memory_in_use()
    except Exception:
        reading = None
    return {
        "enabled": enabled,
        "threshold": MEMORY_PRESSURE,
        "in_use": round(reading[0] / reading[1], 4) if reading and reading[1] else None,
        "sheds": metrics.memory_sheds,
        "last_shed": metrics.last_memory_shed,
    }


def relieve_memory(prefix_cache: PrefixCache | None, metrics: Metrics) -> None:
    """Before a generation, on the engine's thread: past MEMORY_PRESSURE give MLX's buffer cache
    back, and if that is not enough, empty the prefix cache's memory tier (its disk tier
    stays), so a long-running server slows down instead of swapping or running out."""
    if _pressed() is None:
        return
    mx.clear_cache()
    reading = _pressed()
    if reading is None or prefix_cache is None or not prefix_cache.entries:
        return
    held = prefix_cache.bytes
    prefix_cache.clear()
    mx.clear_cache()
    metrics.memory_shed()
    print(f"warning: memory {fit.gb(reading[0])} of {fit.gb(reading[1])} in use: emptied the "
          f"prefix cache ({fit.gb(held)})", file=sys.stderr, flush=True)  # fmt: skip
