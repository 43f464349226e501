"""Compile MLX's CUDA quantized-matmul kernels at load, not in the middle of a generation.

MLX 0.32's CUDA backend builds its quantized matrix kernels (the ones for 8 rows and more;
fewer rows take a precompiled one-row kernel) with NVRTC the first time each is needed: one
kernel per activation type, bits, group size and row tile (16, 32 or 64 rows). On the H200's
host each took 18-46 s to compile (`docs/benchmarks.md`, "A seventh run"). MLX keeps them on
disk afterwards (`MLX_PTX_CACHE_DIR`, which the `outrider` command points at outrider's cache:
core/paths.py `keep_kernels`; else `/tmp/mlx/<version>/ptx`), so it happens once per machine,
but it happens where the shape first occurs: a verify of 17 rows met mid-answer froze
that answer for half a minute. Running each distinct quantized product of the pipeline's models
once per row tile moves every compile to load time, where a warm machine pays milliseconds.

The activation type is the model's compute type (that of its unquantized floating weights:
norms, biases), not the type of the quantization scales: a GGUF target keeps float16 scales
but computes in float32, and warming it at float16 compiled six kernels no generation used
(about five minutes on the H200, `docs/benchmarks.md`, "An eighth run").
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .device import compute_dtype, is_quantized, on_cuda_gpu

# One row count inside each of the kernel's row tiles: 8-16, 17-32 and 33 or more rows.
TILE_ROWS = (8, 17, 33)


def quantized_products(models: Iterable[nn.Module]) -> list[tuple]:
    """The distinct affine-quantized products of `models`' linear layers and tied heads:
    (weight, scales, biases, group size, bits, input width, activation type) per shape. The
    activation type is the model's compute type (`compute_dtype`), else the scales' type."""
    seen, out = set(), []
    for model in models:
        activation = compute_dtype(model)
        for _, m in model.named_modules():
            if not is_quantized(m):
                continue
            dtype = activation or m.scales.dtype
            width = m.weight.shape[-1] * 32 // m.bits
            key = (m.weight.shape[0], width, m.bits, m.group_size, dtype)
            if key in seen:
                continue
            seen.add(key)
            biases = m.get("biases")
            out.append((m.weight, m.scales, biases, m.group_size, m.bits, width, dtype))
    return out


def warm_quantized_kernels(models: Iterable[nn.Module], rows: tuple[int, ...] = TILE_ROWS) -> int:
    """Run every distinct quantized product of `models` once at each row count in `rows`, so
    the backend compiles the kernels a verify, a drafter block or a prefill will use. Returns
    how many products ran. Reads weights only: no cache or state changes."""
    ran = 0
    for w, scales, biases, group, bits, width, dtype in quantized_products(models):
        for n in rows:
            x = mx.zeros((n, width), dtype=dtype)
            y = mx.quantized_matmul(
                x, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits
            )
            mx.eval(y)
            ran += 1
    return ran


def pipeline_models(target: Any, proposer: Any) -> list[nn.Module]:
    """The modules a pipeline computes with: the target's, and the drafter (or the draft model,
    which loads as a Target) its proposer holds. A wrapper such as lookup assistance hands its
    inner proposer's members through."""
    drafter = getattr(proposer, "drafter", None)
    draft = getattr(getattr(proposer, "draft", None), "model", None)
    return [target.model, *(m for m in (drafter, draft) if isinstance(m, nn.Module))]


def warm_at_load(target: Any, proposer: Any) -> tuple[int, float]:
    """On a CUDA GPU, warm the pipeline's quantized kernels; (products run, seconds). Nothing
    runs elsewhere: Metal ships its kernels compiled and the CPU compiles none."""
    if not on_cuda_gpu():
        return 0, 0.0
    t0 = time.perf_counter()
    with mx.stream(target.stream):
        ran = warm_quantized_kernels(pipeline_models(target, proposer))
    return ran, time.perf_counter() - t0
