"""outrider: lossless speculative decoding on MLX.

The public names load on first use (PEP 562), so `outrider --version` and a Ctrl-C during
start-up do not wait for MLX, mlx-lm and transformers to import.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .core import blas

# before anything imports MLX: its CPU backend then multiplies with an optimized BLAS if one is
# installed (core/blas.py says why and how)
blas.preload()

try:
    __version__ = version("outrider")
except PackageNotFoundError:  # a source checkout on PYTHONPATH
    __version__ = "0.1.0"

_WHERE = {
    "Chunk": ".api",
    "Pipeline": ".api",
    "load": ".api",
    "load_pair": ".api",
    "pipeline_from_parts": ".api",
    "speculative_generate": ".api",
    "OutriderError": ".core.errors",
    "Result": ".core.events",
    "Round": ".core.events",
    "SamplingParams": ".core.sampling",
}

__all__ = [*_WHERE, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'outrider' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
