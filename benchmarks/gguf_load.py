"""How fast outrider turns a GGUF file's quantized blocks into MLX arrays (`gguf_blocks.py`).

For each GGML type, one tensor of an 8B model's widest shape (14336 x 4096 by default) in that
type's blocks (gguf-py's quantizer where it has one, else random blocks with sane scales) is
decoded into an MLX affine triple and evaluated, a few times; the table gives the median time,
the file bytes read per second and the weights per second, and what an 8B model of each type
would take at that rate.

    python benchmarks/gguf_load.py
    python benchmarks/gguf_load.py --types Q4_K,Q6_K --rows 4096 --cols 14336 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from outrider.core.gguf_blocks import BITS, BLOCK, affine_triple  # noqa: E402
from outrider.testing.gguf import random_blocks  # noqa: E402

WEIGHTS_8B = 8.0e9


def blocks(qtype: str, shape: tuple[int, int]) -> np.ndarray:
    values = np.random.default_rng(0).normal(0, 0.02, shape).astype(np.float32)
    try:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    except (NotImplementedError, gguf.quants.QuantError):
        return random_blocks(qtype, shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(BITS))
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shape = (args.rows, args.cols)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, tensor {shape[0]} x {shape[1]}")
    print(
        f"{'type':6} {'bits':>4} {'median s':>9} {'MB/s':>7} {'Mweights/s':>11} {'8B model s':>11}"
    )
    for qtype in args.types.split(","):
        raw = blocks(qtype, shape).reshape(-1)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            mx.eval(*affine_triple(qtype, raw, shape, qtype))
            times.append(time.perf_counter() - t)
        median = statistics.median(times)
        per_block, size = BLOCK[qtype]
        weights = shape[0] * shape[1]
        assert raw.nbytes == weights // per_block * size
        rate = weights / median
        print(
            f"{qtype:6} {BITS[qtype]:>4} {median:>9.3f} {raw.nbytes / 1e6 / median:>7.0f} "
            f"{rate / 1e6:>11.0f} {WEIGHTS_8B / rate:>11.0f}"
        )


if __name__ == "__main__":
    main()
