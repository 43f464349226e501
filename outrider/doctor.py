"""`outrider doctor`: versions, backends, plugins, caches and calibrations, with whatever is
wrong spelled out."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import typer

from . import __version__
from .cli_common import cache_root, plugins
from .cli_common import console as _console
from .cli_common import print_json as _print_json
from .core import cuda_graphs
from .core.device import (
    attention_buckets,
    fused_attention,
    kv_attention,
    matmul_choice,
    on_cuda_gpu,
    pipelined_rounds,
    split_attention,
    tf32_matmuls,
)
from .core.errors import OutriderError
from .core.paths import PTX_CACHE_ENV, mlx_kernel_cache
from .core.roofline import BANDWIDTH_ENV, peak_bandwidth

Opt = typer.Option


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _backend(mx: Any, name: str) -> bool | None:
    """Whether mx.<name> says it is available (None: this MLX build has no such backend)."""
    backend = getattr(mx, name, None)
    try:
        return bool(backend.is_available()) if backend is not None else None
    except Exception:
        return False


def _mlx_report(problems: list[str]) -> dict:
    import mlx.core as mx

    try:
        if (mx.arange(4) * 2).sum().item() != 12:
            problems.append("MLX computed 2*(0+1+2+3) wrongly")
    except Exception as e:
        problems.append(f"MLX failed a tiny computation: {type(e).__name__}: {e}")
    return {
        "mlx_version": getattr(mx, "__version__", None),
        "mlx_default_device": str(mx.default_device()),
        "metal_available": _backend(mx, "metal"),
        "cuda_available": _backend(mx, "cuda"),
    }


def _place(path: Path) -> dict:
    return {"path": str(path), "exists": path.is_dir()}


def doctor_report() -> dict:
    """Everything worth knowing when something does not work, with the problems spelled out."""
    from huggingface_hub import constants

    from .core import calibration
    from .core.hub import lmstudio_roots, model_roots

    problems: list[str] = []
    report: dict[str, Any] = {
        "outrider_version": __version__,
        "python_version": platform.python_version(),
        "python": sys.executable,
        "platform": platform.platform(),
        **_mlx_report(problems),
        "mlx_lm_version": _dist_version("mlx-lm"),
    }
    if report["mlx_lm_version"] is None:
        problems.append("mlx-lm is not installed")
    plug = plugins()
    report["plugins"] = [vars(p) for p in plug.info()]
    report["target_families"] = sorted(plug.families)
    if not plug.families:
        problems.append("no plugin provides a target family: no model can be loaded")
    if not plug.strategies:
        problems.append("no plugin provides a drafting strategy")
    try:
        split = split_attention()
        report["attention"] = "split" if split else "native"
        # half-precision multi-row attention at bucketed shapes (plugins/targets/verify_attention.py)
        report["attention_buckets"] = split and attention_buckets()
        # a verify's attention as outrider's two CUDA kernels (plugins/targets/fused_attention.py)
        kernels = "fused" if fused_attention() else "softmax"
        report["attention_kernels"] = kernels if on_cuda_gpu() else f"none here ({kernels} on CUDA)"
    except OutriderError as e:
        report["attention"] = None
        problems.append(str(e))
    try:  # greedy rounds queued behind the one in flight (core/ahead_gate.py)
        report["pipelined_rounds"] = {"gated": "on (while guesses hold)", "on": "on"}.get(
            pipelined_rounds(), "off"
        )
    except OutriderError as e:
        report["pipelined_rounds"] = None
        problems.append(str(e))
    try:  # a long parked run's taps recomputed where it ends (core/parked.py `RETAP_FROM`)
        from .core.parked import retap_from

        past = retap_from()
        report["parked_taps"] = f"recomputed past {past} steps" if past else "every step"
    except OutriderError as e:
        report["parked_taps"] = None
        problems.append(str(e))
    try:  # quantized products of a few rows (core/row_kernels.py): whose, and where they run
        choice = matmul_choice()
        usable = [k for k in plug.kernels.values() if k.available()]
        used = "mlx"
        if usable and choice == "rows":
            used = f"{usable[0].name}, siblings grouped"
        elif usable and choice == "auto":
            used = f"{usable[0].name} where measured faster (siblings grouped), else mlx"
        if usable and choice in ("rows", "auto"):  # the kernel's say on prefill chunks
            if callable(getattr(usable[0], "dense_rows", None)):
                used += "; prefill chunks of 4-bit weights dequantized where measured faster"
        here = ", ".join(k.name for k in usable) or "none"
        report["quantized_rows"] = (
            f"{used} (OUTRIDER_MATMUL={choice}; kernels that run here: {here})"
        )
    except OutriderError as e:
        report["quantized_rows"] = None
        problems.append(str(e))
    # MLX's CUDA graphs, as this environment sets them (core/cuda_graphs.py): serve turns them
    # off where rows batch; only a CUDA GPU reads the variable
    graphs = cuda_graphs.state()
    report["cuda_graphs"] = (
        f"{graphs} ({cuda_graphs.ENV}; serve --max-batch above 1 turns them off)"
        if on_cuda_gpu()
        else f"none here ({graphs} on CUDA; serve --max-batch above 1 turns them off)"
    )
    # MLX's CUDA backend (and Apple's M5) multiply float32 in TF32 unless told not to: greedy
    # float32 output may then part from a one-row run at near-ties (docs/benchmarks.md)
    report["float32_matmuls"] = (
        "tf32 (MLX_ENABLE_TF32=0: full float32)" if tf32_matmuls() else "float32"
    )
    try:  # --kv-bits: how attention reads a quantized cache here (core/kv_quant.py)
        report["kv_bits"] = f"8, 4 (attention reads the cache {kv_attention()})"
    except OutriderError as e:
        report["kv_bits"] = None
        problems.append(str(e))
    # peak memory bandwidth: what bounds plain decoding (core/roofline.py, GET /machine)
    gb_s, source = peak_bandwidth()
    report["memory_bandwidth"] = (
        f"{gb_s:g} GB/s ({source}: {'the vendor' if source == 'spec' else BANDWIDTH_ENV})"
        if gb_s
        else f"unknown for this device (set {BANDWIDTH_ENV} to give it)"
    )
    report["cpu_blas"] = _blas_report()
    try:  # norms and ropes fused on the CPU (core/cpu_fusion.py)
        report["cpu_fusion"] = _fusion_report()
    except OutriderError as e:
        report["cpu_fusion"] = None
        problems.append(str(e))
    try:  # dense layers' fixed-shape parts compiled (core/compiled_layers.py)
        report["compiled_layers"] = _compiled_layers_report()
    except OutriderError as e:
        report["compiled_layers"] = None
        problems.append(str(e))
    report["hf_cache"] = _place(Path(constants.HF_HUB_CACHE))
    report["lmstudio_dirs"] = [_place(p) for p in lmstudio_roots()]
    report["model_dirs"] = [
        {"source": source, **_place(p)} for p, source in model_roots() if source != "LM Studio"
    ]
    report["outrider_cache"] = _place(cache_root())
    report["cuda_kernel_cache"] = _kernel_cache_report()
    report["calibrations"] = [
        {**c.key, "created": c.created, "quick": c.quick, "file": str(c.path)}
        for c in calibration.stored()
    ]
    try:  # whether generate, serve and benchmark measure a pair on its first run
        report["calibrate_on_first_use"] = calibration.on_first_use()
    except OutriderError as e:
        report["calibrate_on_first_use"] = None
        problems.append(str(e))
    report["problems"] = problems
    return report


def _kernel_cache_report() -> str:
    """Where MLX keeps the CUDA kernels it compiles (core/paths.py `keep_kernels`): a folder
    that outlives a reboot saves minutes at the first load after one."""
    chosen = os.environ.get(PTX_CACHE_ENV)
    if not on_cuda_gpu():
        return f"not used here (CUDA only){f': {chosen}' if chosen else ''}"
    if chosen:
        return chosen
    return f"{mlx_kernel_cache()} (MLX's default: emptied at boot on most systems)"


def _fusion_report() -> str:
    """Whether loaded models' norms and ropes run fused by `mx.compile` (core/cpu_fusion.py)."""
    import mlx.core as mx

    from .core.cpu_fusion import FUSION_ENV, cpu_fusion

    if cpu_fusion():
        return f"norms and ropes (bit-identical to MLX's own; {FUSION_ENV}=off: MLX's path)"
    if mx.default_device() != mx.cpu:
        return "not used (MLX's GPU kernels are fused already)"
    return f"off ({FUSION_ENV})"


def _compiled_layers_report() -> str:
    """Whether dense targets' layers and block drafters run their fixed-shape parts compiled."""
    from .core.compiled_layers import ENV, compiled_layers

    if compiled_layers():
        return (
            "on: llama, qwen2 and qwen3 layers, where bit-identical at load, and DSpark/DFlash "
            f"drafters ({ENV}=off: not)"
        )
    return f"off ({ENV}=on compiles them here too)"


def _blas_report() -> str:
    """The BLAS MLX's CPU backend multiplies floats with (core/blas.py)."""
    from .core import blas

    state = blas.state()
    if state.optimized:
        return state.path
    hint = ""
    if state.note == blas.NOT_FOUND:
        hint = " (Debian/Ubuntu: apt install libopenblas0)"
    return f"MLX's own: {state.note}{hint}"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['path']} ({'exists' if value['exists'] else 'absent'})"
    return {True: "yes", False: "no", None: "n/a"}.get(value, str(value))


def doctor(as_json: bool = Opt(False, "--json", help="Print JSON.")) -> None:
    """Check the installation: versions, backends, plugins, caches, problems."""
    from rich.table import Table

    report = doctor_report()
    if as_json:
        _print_json(report)
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    for key, value in report.items():
        if key == "plugins":
            value = ", ".join(p["name"].rsplit(".", 1)[-1] for p in value)
        if key == "target_families":
            value = ", ".join(value)
        if key == "calibrations":
            quick = sum(1 for c in value if c["quick"])
            value = (
                f"{len(value)} kept (a pair's first run, or outrider calibrate; --json lists them)"
                + (f"; {quick} quick (a slow machine's first run)" if quick else "")
            )
        if key not in ("problems", "lmstudio_dirs", "model_dirs"):
            table.add_row(key.replace("_", " "), _shown(value))
    for place in report["model_dirs"]:
        table.add_row(f"model dir ({place['source']})", _shown(place))
    for place in report["lmstudio_dirs"]:
        table.add_row("lm studio dir", _shown(place))
    console = _console()
    console.print(table)
    for problem in report["problems"]:
        console.print(f"[red]problem:[/red] {problem}")
    if not report["problems"]:
        console.print("[green]no problems found[/green]")
