"""What `/health` warns about, one entry a condition: `{code, level, message, action}`, so
a client (the web page, an agent's launcher) can show each and say what to do about it."""

from __future__ import annotations

from typing import Any

from .machine import host_bound


def warning(code: str, level: str, message: str, action: str | None = None) -> dict[str, Any]:
    return {"code": code, "level": level, "message": message, "action": action}


def collect(engine: Any) -> list[dict[str, Any]]:
    """The running server's warnings: the load's fit check, the load's notes (a fallback, a
    kernel not used), a warm-up that failed, a prefix cache turned off for this model, a
    plain step far below the bandwidth ceiling (the roofline's `structural` verdict), and
    memory pressure that emptied the prefix cache."""
    out = []
    if engine.warning:
        out.append(warning(
            "kv_may_not_fit", "warn", engine.warning,
            "lower --context-window (or /admin/load context_window), or quantize the cache "
            "with --kv-bits 8",
        ))  # fmt: skip
    if engine.warm_up_error:
        out.append(warning(
            "warm_up_failed", "info", engine.warm_up_error,
            "none needed: the first request builds the kernels instead",
        ))  # fmt: skip
    pipe = engine.pipeline
    for note in getattr(pipe, "notes", None) or ():
        out.append(warning("load_note", "info", note))
    store = engine.prefix_cache
    off = store.disabled_reason if store is not None else None
    if off:
        out.append(warning(
            "prefix_cache_off", "warn", f"prefix cache off for this model: {off}",
            "none: every request prefills its whole prompt",
        ))  # fmt: skip
    verdict = host_bound(pipe) if pipe is not None else None
    if verdict is not None:
        out.append(warning(
            "host_bound", "info", verdict["headline"],
            "none needed: --max-draft auto parks drafting where it does not pay (GET /machine)",
        ))  # fmt: skip
    sheds = engine.metrics.memory_sheds
    if sheds:
        out.append(warning(
            "memory_shed", "warn",
            f"memory ran short {sheds} time(s); the prefix cache's memory tier was emptied",
            "lower --prefix-cache-gb or --max-batch, or load a smaller model",
        ))  # fmt: skip
    return out
