"""The server's memory: a warning at load when the KV cache at the context window would not fit
(core/fit.py `load_warning`), and relief before a generation when memory runs short."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..core import fit
from ..core.prefix_cache import PrefixCache
from .metrics import Metrics

# The share of this machine's memory in use (core/fit.py `memory_in_use`) past which a
# generation first empties MLX's buffer cache, then the prefix cache (`relieve_memory`).
MEMORY_PRESSURE = 0.9

# Seconds between two of `HeapTrim`'s trims, at least.
TRIM_EVERY_S = 10.0


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


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrim:
    """Hands the C heap's free memory back to the OS (glibc's `malloc_trim`) at most once every
    `every_s` seconds, asked between a server's generations and batched rounds.

    glibc keeps what is freed in its arenas for reuse, and what a server frees (MLX's buffers
    past its own cache, the tokenizer's and the HTTP stack's) piles up there: in the soak
    (benchmarks/soak.py, 2-core CPU) resident memory crept about 90 KB a request, +5.7-6.8% over
    375 requests, +126 MB over 1,400, while MLX's own memory and Python's objects stayed flat,
    and one trim took it back to where it began. A trim took 7-17 ms there. Where the C library
    has no `malloc_trim` it does nothing."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self._trim = trim if trim is not None else malloc_trim()
        self._clock = clock
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe(self) -> bool:
        """Trim if `every_s` has passed since the last one; whether it did."""
        if self._trim is None:
            return False
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._trim(0)
        self._last = self._clock()
        self.trims += 1
        return True
