"""The recipe's summary: sizes, hardware, acceptance figures, printed and written to recipe.json."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from .presets import SIZE_LIMIT_MB


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def hardware() -> dict:
    import mlx.core as mx

    info = {"platform": platform.platform(), "python": platform.python_version()}
    info["mlx"] = getattr(mx, "__version__", "?")
    info["device"] = str(mx.default_device())
    try:
        info["device_info"] = {
            k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))
        }
    except Exception:
        pass
    info["cpus"] = os.cpu_count()
    return info


def accept_numbers(report: dict, prefix: str = "") -> list[tuple[str, float]]:
    """Every acceptance figure in a train report, nested ones named by their path."""
    found = []
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += accept_numbers(value, name + ".")
        elif "accept" in name and isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((name, float(value)))
    return found


def print_summary(s: dict) -> None:
    hw = s["hardware"]
    lines = [
        f"preset       {s['preset']}",
        f"hardware     {hw.get('device_info', {}).get('device_name', hw['device'])} · "
        f"{hw['platform']} · python {hw['python']} · mlx {hw['mlx']}",
    ]
    if "target_reused" in s:
        lines.append(f"target       reused from {s['target_reused']}")
    else:
        lines += [
            f"corpus       {s['corpus']['files']} files, {s['corpus']['bytes'] / 1e6:.1f} MB, "
            f"{s['corpus']['licence']}",
            f"target       {s['target_steps']} steps, {s['target_tokens_per_second']:,.0f} "
            f"tok/s, val loss {s['val_loss_start']:.3f} → {s['val_loss_float']:.3f} "
            f"({s['settings']['bits']}-bit: {s['val_loss_quantized']:.3f})",
        ]
    for kind, d in s["drafters"].items():
        acc = ", ".join(f"{k} {v:.3g}" for k, v in accept_numbers(d["report"]))
        lines.append(f"{kind:<12} {d['mb']} MB {acc}")
    lines.append(
        "sizes MB     "
        + ", ".join(f"{k} {v}" for k, v in s["sizes_mb"].items())
        + f" · total {s['total_mb']} (limit {SIZE_LIMIT_MB})"
    )
    lines.append(
        "time s       "
        + ", ".join(f"{k} {v}" for k, v in s["seconds"].items())
        + f" · total {s['total_seconds']}"
    )
    print("\n".join(lines), flush=True)
