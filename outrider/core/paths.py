"""Where outrider keeps its own files (calibrations, converted drafters, compiled GPU kernels)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from importlib import metadata
from pathlib import Path

# MLX's CUDA backend keeps the kernels it compiles with NVRTC in this folder (read once, at its
# first compile), else in /tmp/mlx/<version>/ptx
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def cache_root() -> Path:
    """$OUTRIDER_CACHE, else ~/.cache/outrider."""
    env = os.environ.get("OUTRIDER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outrider"


def kernel_cache() -> Path | None:
    """Where the `outrider` command keeps MLX's compiled CUDA kernels: outrider's cache, a
    folder per MLX version (a kernel's file is named for what it computes, not for MLX's
    source, so another version must not read it). None where MLX's version is unknown."""
    version = _mlx_version()
    return None if version is None else cache_root() / "mlx" / version / "ptx"


def mlx_kernel_cache() -> Path | None:
    """MLX's own folder for them, where PTX_CACHE_ENV is unset: <temp>/mlx/<version>/ptx."""
    version = _mlx_version()
    return None if version is None else Path(tempfile.gettempdir()) / "mlx" / version / "ptx"


def _mlx_version() -> str | None:
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return None


def keep_kernels(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Point MLX's CUDA kernel cache at `kernel_cache()` where nobody chose one, and return the
    folder MLX will use (None: MLX's default).

    MLX's default, /tmp/mlx/<version>/ptx, is emptied at every boot on most Linux systems, and
    a cold cache costs minutes at the first load after it: each quantized kernel takes 18-46 s
    of NVRTC on an H200's host (docs/performance.md, "Kernels compiled on first use on CUDA").
    The command line calls this for its own process, before any GPU work; a Python program
    that loads through the library chooses its own environment. A folder that cannot be
    made leaves MLX's default (MLX would keep nothing there); MLX makes the folder itself, at its
    first compile, so a command that compiles nothing leaves no trace."""
    chosen = environ.get(PTX_CACHE_ENV)
    if chosen:
        return chosen
    folder = kernel_cache()
    if folder is None or not _can_make(folder):
        return None
    environ[PTX_CACHE_ENV] = str(folder)
    return str(folder)


def _can_make(folder: Path) -> bool:
    """Whether `folder` exists or its nearest existing parent lets this user make it."""
    for place in (folder, *folder.parents):
        if place.exists():
            return place.is_dir() and os.access(place, os.W_OK | os.X_OK)
    return False
