"""Which backend MLX computes on: some kernel choices and precisions depend on it."""

from __future__ import annotations

import os
import platform
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import blas
from .env import env_choice


def release_streams() -> None:
    """Destroy the MLX streams this thread made (`Target.stream` makes one a thread). MLX asks
    every thread that made one to do this before it ends, the main thread included: streams
    still alive as the interpreter exits can abort the process after its work is done
    ("terminate called without an active exception", exit status 134; ml-explore/mlx#3395,
    `mx.clear_streams`). An MLX without `clear_streams` cleans up by itself."""
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()


def on_cuda_gpu() -> bool:
    """True when MLX's default device is a GPU driven by the CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


KV_ATTENTION_ENV = "OUTRIDER_KV_ATTENTION"


def kv_attention() -> str:
    """How attention reads a quantized KV cache (`--kv-bits`; core/kv_quant.py): `dequantized`
    on a CUDA GPU, where MLX 0.32's quantized attention raised at some shapes and decoded wrong
    tokens at others (docs/testing-on-gpu.md), else `quantized` (MLX's quantized product, as
    mlx-lm runs it); OUTRIDER_KV_ATTENTION=quantized or dequantized forces it."""
    choice = env_choice(KV_ATTENTION_ENV, ("auto", "quantized", "dequantized"))
    if choice == "auto":
        return "dequantized" if on_cuda_gpu() else "quantized"
    return choice


def tf32_matmuls() -> bool:
    """True when float32 matrix products run at reduced precision (TF32, a 10-bit mantissa): on
    a CUDA GPU, and on an Apple GPU with neural accelerators (`metal_matmul_units`), unless
    MLX_ENABLE_TF32=0 (MLX's own switch, read once when MLX first multiplies; MLX's
    "Numerical Precision" page)."""
    if os.environ.get("MLX_ENABLE_TF32", "1").strip() == "0":
        return False
    if on_cuda_gpu():
        return True
    if mx.default_device() != mx.gpu or not mx.metal.is_available():
        return False
    try:
        architecture = str(mx.device_info().get("architecture", ""))
    except Exception:  # an MLX without device_info: assume MLX's default precision is full
        return False
    return metal_matmul_units(architecture, platform.mac_ver()[0])


def metal_matmul_units(architecture: str, macos: str) -> bool:
    """Whether MLX's Metal backend runs float32 products on the GPU's neural accelerators, as
    MLX 0.32's `is_nax_available` decides: macOS 26.2 or later, and a GPU generation (the two
    digits before the architecture name's last letter, "applegpu_g17s": 17) of 17 or more, 18
    for phone parts (last letter "p"). Apple's M5 is the first such Mac."""
    release = tuple(int(x) for x in macos.split(".")[:2] if x.isdigit())
    if len(architecture) < 3 or not architecture[-3:-1].isdigit() or release < (26, 2):
        return False
    return int(architecture[-3:-1]) >= (18 if architecture[-1] == "p" else 17)


ATTENTION_ENV = "OUTRIDER_ATTENTION"
BUCKETS_ENV = "OUTRIDER_ATTENTION_BUCKETS"


def attention_buckets() -> bool:
    """OUTRIDER_ATTENTION_BUCKETS: `on` (the default), `all` or `off`. On, rerouted
    half-precision attention over one sequence's KV cache runs at a few fixed shapes, so MLX
    meets a new one once per 256 keys rather than every call (plugins/targets/
    verify_attention.py); `all` does the same for a batch's rows (not yet timed on a GPU);
    off keeps the exact shapes (one row per kernel call, or plain matmuls), as before
    2026-12-04."""
    return _buckets_choice() != "off"


def batch_buckets() -> bool:
    """Whether a batch's rows are bucketed too (OUTRIDER_ATTENTION_BUCKETS=all)."""
    return _buckets_choice() == "all"


def _buckets_choice() -> str:
    return env_choice(BUCKETS_ENV, ("on", "all", "off"))


KERNELS_ENV = "OUTRIDER_ATTENTION_KERNELS"


def fused_attention() -> bool:
    """OUTRIDER_ATTENTION_KERNELS: `fused` (the default) or `softmax`. Bucketed attention on a
    CUDA GPU runs a verify's few rows over a cache of up to 2,048 keys as two attention kernels
    of outrider's own (plugins/targets/fused_attention.py), and everything else as MLX's
    matmuls around outrider's causal softmax kernel; `softmax` keeps the latter for all.
    Measured on an H100 (docs/performance.md)."""
    choice = env_choice(KERNELS_ENV, ("fused", "softmax"))
    return choice == "fused"


PIPELINE_ENV = "OUTRIDER_PIPELINED_ROUNDS"


def pipelined_rounds() -> str:
    """OUTRIDER_PIPELINED_ROUNDS: `auto` (the default) queues a greedy round behind the one
    in flight where that pays, from the share of guesses that hold and what a round's host
    and device parts cost here (core/ahead_gate.py `AheadGate`); `on` whenever the proposer can
    guess ahead; `off` never."""
    choice = env_choice(PIPELINE_ENV, ("auto", "on", "off"))
    return "gated" if choice == "auto" else choice


RETAP_ENV = "OUTRIDER_RETAP"


def retap_choice() -> str:
    """OUTRIDER_RETAP: `auto` (the default) lets a long parked run on a CUDA GPU forward no
    taps past its first steps and recompute them in one forward where it ends (core/parked.py
    `RETAP_FROM`); `on` does so on any device; `off` taps every step."""
    return env_choice(RETAP_ENV, ("auto", "on", "off"))


def computes_on_host() -> bool:
    """Whether MLX's default device is the CPU: the host's own cores run the graphs it
    builds, so work queued for nothing competes with the host's (pipelined rounds)."""
    return mx.default_device() == mx.cpu


def attention_choice() -> str:
    """OUTRIDER_ATTENTION: auto (the default), split or native."""
    return env_choice(ATTENTION_ENV, ("auto", "split", "native"))


def split_attention() -> bool:
    """Whether multi-row attention is rerouted: verify and draft rows split to fit MLX's fused
    one-query kernel, and other multi-row half-precision calls run as plain matmuls.

    That kernel takes fewer than 4 query rows on MLX's CUDA backend (up to 8 on Metal, and the
    CPU runs every width as the same unfused ops), and its half-precision path for more rows
    builds a cuDNN graph per new shape, so `auto` reroutes on CUDA only; `split` and `native`
    force the choice. See plugins/targets/verify_attention.py.
    """
    choice = attention_choice()
    return choice == "split" or (choice == "auto" and on_cuda_gpu())


MATMUL_ENV = "OUTRIDER_MATMUL"
# MLX 0.32's CUDA backend multiplies 2-7 rows by a quantized matrix as that many one-row
# products (reading the weights once per row) and switches to a kernel that reads them once
# from 8 rows on; on the H200 a whole 8-row forward of a 4-bit 8B costs what a 3-row one does
# (benchmarks/quantized_verify.py), so a verify of 4-7 rows is cheaper padded to 8 rows.
PADDED_VERIFY_ROWS = 8
PADDED_FROM = 4  # 2 and 3 rows cost less unpadded (H200: 14.3 and 18.5 ms against 18.8 and 18.9)


def matmul_choice() -> str:
    """OUTRIDER_MATMUL: `auto` (the default: a rows kernel where it was measured faster than
    MLX's products, CUDA's tensor-core form; MLX's products padded elsewhere), `native` (MLX's
    products, verify forwards never padded) or `rows` (quantized products of a few rows
    through outrider's CUDA kernel wherever it runs, with sibling layers grouped into one
    launch, plugins/kernels/cuda_rows.py; never padded)."""
    return env_choice(MATMUL_ENV, ("auto", "native", "rows"))


def verify_pad(model: Any) -> int:
    """The width a verify forward of a few rows pads to before a calibration measures it
    (0: none): PADDED_VERIFY_ROWS on CUDA GPUs when the model has affine-quantized linear
    layers, unless OUTRIDER_MATMUL is set or a rows kernel stands in front of them
    (core/row_kernels.py)."""
    from .row_kernels import installed

    if matmul_choice() != "auto" or not on_cuda_gpu() or installed(model):
        return 0  # through a rows kernel a few rows cost about what one does
    quantized = any(is_quantized(m, (nn.QuantizedLinear,)) for _, m in model.named_modules())
    return PADDED_VERIFY_ROWS if quantized else 0


# Dequantized float32 weights may take at most this share of the machine's memory.
DENSE_MEMORY_SHARE = 0.25


def dense_on_cpu(model: Any) -> bool:
    """Whether a quantized target runs dequantized in float32 here: on the CPU, with an
    optimized BLAS loaded (core/blas.py), unless OUTRIDER_MATMUL is set, when its float32
    weights fit DENSE_MEMORY_SHARE of the memory.

    MLX's CPU quantized matmul multiplies row by row (a 5-row verify forward of the demo target
    costs 3.2x one row, 44 against 14 ms, on 2 cores) and its float16 products are slower
    still; float32 products through OpenBLAS cost about the same for 1 to 8 rows. Plain
    decoding, every mode and the benchmark's mlx-lm arm then run the same float32 model."""
    if matmul_choice() != "auto" or mx.default_device() != mx.cpu:
        return False  # `rows` keeps the layers quantized for the kernel
    if not blas.state().optimized:
        return False
    return dense_fits(model, 4)


def dense_fits(model: Any, itemsize: int) -> bool:
    """Whether `model` has quantized layers, and their weights dequantized to `itemsize`-byte
    floats fit DENSE_MEMORY_SHARE of the machine's memory."""
    quantized = [m for _, m in model.named_modules() if is_quantized(m)]
    if not quantized:
        return False
    weights = sum(m.weight.size * 32 // m.bits for m in quantized)
    return weights * itemsize <= DENSE_MEMORY_SHARE * _memory_bytes()


def is_quantized(
    module: Any, kinds: tuple[type, ...] = (nn.QuantizedLinear, nn.QuantizedEmbedding)
) -> bool:
    """Whether `module` is one of `kinds` holding MLX affine-quantized weights."""
    return isinstance(module, kinds) and getattr(module, "mode", "affine") == "affine"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def make_dense(model: Any, dtype: mx.Dtype = mx.float32) -> None:
    """Dequantize `model`'s quantized layers in place (mlx-lm's `dequantize_model`), every
    floating parameter cast to `dtype` first, so the dequantized weights are exact in float32
    (and rounded once in a half type)."""
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    def cast(a: mx.array) -> mx.array:
        return a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a

    model.update(tree_map(cast, model.parameters()))
    dequantize_model(model)  # its weights come out in the scales' type, `dtype` by now
    mx.eval(model.parameters())


def one_group_wide(width: int, bits: int, group_size: int) -> bool:
    """Whether a `bits`-bit product of input width `width` in groups of `group_size` is one MLX
    0.32's CUDA backend sends to its Hopper kernel (`supports_qmm_sm90`: bits 4 or 8, width a
    multiple of 64 and at most the group size), which computed wrong values on the H200."""
    return bits in (4, 8) and width % 64 == 0 and width <= group_size


def single_group(module: Any) -> bool:
    """Whether `module` is a quantized linear or embedding layer whose products are
    `one_group_wide` (a toy model's layers)."""
    if not is_quantized(module):
        return False
    return one_group_wide(
        module.weight.shape[-1] * 32 // module.bits, module.bits, module.group_size
    )


def dense_single_groups(model: Any) -> int:
    """On a CUDA GPU, dequantize `model`'s `single_group` layers in place; returns how many.

    MLX 0.32's CUDA backend sends a quantized product of two or more rows to its Hopper (sm90)
    kernel when a weight row is one group of 4 or 8 bits, and there it returned wrong values on
    the H200: relative error ~1 against the CPU for a 64 x 64 matrix of group 64 at 2 and 8
    rows, float32 and bfloat16 alike, while one row was right
    (docs/receipts/mlx_cuda_primitives_h200.txt). Splitting the group in two instead would be
    exact, but MLX 0.32 has no CUDA kernel for groups of 32 at most output widths. Only toy
    models have such layers (real rows are hundreds of groups wide), and one dequantized costs a
    few kilobytes. Only MLX's own two classes are swapped: a subclass (a scaled embedding, a
    soft-capped head) would lose what it adds, so drafters leave such layers unquantized on a
    CUDA GPU instead (`drafter_weights.quantize`)."""
    from mlx.utils import tree_unflatten

    if not on_cuda_gpu():
        return 0
    swaps = []
    for name, m in model.named_modules():
        if type(m) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or not single_group(m):
            continue
        weight = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
        if isinstance(m, nn.QuantizedEmbedding):
            dense = nn.Embedding(*weight.shape)
        else:
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                dense.bias = m.bias
        dense.weight = weight
        swaps.append((name, dense))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        mx.eval(model.parameters())
    return len(swaps)


def scales_dtype(model: Any) -> mx.Dtype | None:
    """The float type of a quantized model's scales, or None. Not always what it computes in
    (`compute_dtype`): a GGUF target keeps float16 scales and computes in float32."""
    for _, m in model.named_modules():
        if is_quantized(m):
            return m.scales.dtype
    return None


def compute_dtype(model: Any) -> mx.Dtype | None:
    """The floating type `model` computes in: the most common type among the floating arrays
    of its unquantized modules (norms, biases, unquantized layers); None when it has none."""
    counts: Counter = Counter()
    for _, m in model.named_modules():
        if is_quantized(m):
            continue
        for v in m.values():  # a module's own arrays, not its children's
            if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating):
                counts[v.dtype] += 1
    return counts.most_common(1)[0][0] if counts else None
