"""The benchmark receipt: one JSON object, stamped with the device and software it ran on.

Its format is documented in outrider/registry/receipts/README.md; registry rows cite receipts.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..core.device import split_attention
from .runner import BenchConfig, Report, summary

SCHEMA = "outrider-benchmark/1"
# device_info keys that name one physical card or a passing moment, not the kind of device
UNSTAMPED = {"uuid", "pci_bus_id", "free_memory"}


def _dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _available(backend: str) -> bool:
    module = getattr(mx, backend, None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:
        return False


def device_stamp() -> dict:
    """Chip or GPU (from `mx.device_info()`), backend and memory of the default device."""
    try:
        info = {k: _plain(v) for k, v in mx.device_info().items() if k not in UNSTAMPED}
    except Exception:  # an MLX build without device_info
        info = {}
    backend = "cuda" if _available("cuda") else "metal" if _available("metal") else "cpu"
    if mx.default_device().type == mx.DeviceType.cpu:
        backend = "cpu"
    memory = info.get("memory_size") or info.get("total_memory")
    return {
        "chip": info.get("device_name") or platform.processor() or platform.machine(),
        "backend": backend,
        "default_device": str(mx.default_device()),
        "memory_gb": round(memory / 1e9, 2) if isinstance(memory, (int, float)) else None,
        "device_info": info,
    }


def software_stamp() -> dict:
    from .. import __version__

    return {
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "mlx": getattr(mx, "__version__", None),
            "mlx_lm": _dist_version("mlx-lm"),
            "outrider": __version__,
        },
    }


def build_receipt(report: Report, config: BenchConfig, command: str) -> dict:
    """Everything needed to trust or rerun the numbers: where, what, how, and the results."""
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": device_stamp(),
        **software_stamp(),
        "model": report.model,
        "settings": {
            "modes": [a["mode"] for a in report.arms],
            "caps": {a["mode"]: a["cap"] for a in report.arms},
            "suites": report.suites,
            "trials": config.trials,
            "max_tokens": config.max_tokens,
            "greedy": True,
            "drafter_bits": config.drafter_bits,
            "lookup_drafts": config.lookup_drafts,  # None: the registry row's `lookup`, else on
            "lookup_long_draft": config.lookup_long_draft,  # None: the default (32; lookup 16)
            "drafter_window": config.drafter_window,  # None: the row's, else 4096; 0: all rows
            "thinking": config.thinking,
            "attention": "split" if split_attention() else "native",
        },
        "arms": report.arms,
        "results": [c.to_json() for c in report.cells],
        "timeline": report.timeline,
        "lossless": summary(report),
    }


def write_receipt(receipt: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=2, ensure_ascii=False) + "\n")
    return path
