"""outrider: lossless speculative decoding on MLX."""

from importlib.metadata import PackageNotFoundError, version

from .api import Chunk, Pipeline, load, load_pair, pipeline_from_parts, speculative_generate
from .core.errors import OutriderError
from .core.events import Result, Round
from .core.sampling import SamplingParams

try:
    __version__ = version("outrider")
except PackageNotFoundError:  # a source checkout on PYTHONPATH
    __version__ = "0.1.0"

__all__ = [
    "Chunk",
    "OutriderError",
    "Pipeline",
    "Result",
    "Round",
    "SamplingParams",
    "load",
    "load_pair",
    "pipeline_from_parts",
    "speculative_generate",
    "__version__",
]
