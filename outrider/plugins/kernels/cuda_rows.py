"""A quantized matrix product of a few rows on CUDA that reads each weight once for all rows.

A verify forward multiplies 1 + cap rows by every weight matrix. MLX 0.32's CUDA backend runs
2-7 rows of an affine-quantized product as that many one-row products, each reading the
weights again, and 8 or more through a tiled kernel that costs about two one-row products in a
whole forward (docs/performance.md, "Quantized verify widths on CUDA"). Decoding is bound by
reading weights, so a few rows should cost what one row does.

This kernel gives each warp R output columns (weight rows) and each lane a stretch of the
input dimension: a lane reads 16 bytes of packed weights per weight row per step (4 words:
32 values at 4 bits, 16 at 8; always inside one quantization group), dequantizes each value
once (scale * q + bias, in float32) and multiplies it into all M input rows, which it reads as
16-byte vectors. The warp then sums its lanes (a butterfly of shuffles) and lane 0 writes.

Every row's arithmetic is the same whatever M is (the row loop is innermost and each row has
its own accumulators), so row i of an M-row product is bit for bit row i computed alone: a
verify's rows equal plain decoding's where both run this kernel. Against MLX's own product
the sums run in another order: agreement to float32 rounding, and to the activation type's
rounding of the result.

The kernels' CUDA code, each form's, is in `cuda_rows_code.py`; this module chooses a form and
a launch for each product's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...core.device import on_cuda_gpu
from ...core.hookspecs import hookimpl
from .cuda_rows_code import VERSION, kernel_body

# Rows of input one call takes: beyond this MLX's tiled kernel reads the weights once already,
# and one row runs MLX's own (CudaRows.min_rows says why).
MIN_ROWS = 2
MAX_ROWS = 8
# The rows kernel takes up to MMA_ROWS rows (`CudaRows.rows_up_to`): a verify, a prefix hit's
# tail, a short prompt's prefill. The tensor-core form (`rows_mma`, rows in groups of 8, each
# step's weights dequantized once for all of them) runs up to WIDE_ROWS; it reads every input
# row again (from L2) for each 16-row tile of weights, traffic that grows with rows x outputs.
# Past WIDE_ROWS the gemm form (`rows_gemm`) runs: each step's inputs staged once a block in
# shared memory and read with ldmatrix, 8-row weight fragments a warp (GEMM_NT), warps a block
# (GEMM_WARPS); a product with few weight rows splits its input width into shares (`shares`)
# until its blocks reach about GEMM_BLOCKS, each share at least GEMM_MIN_STEPS steps of 128
# inputs. On an H100 at 40-64 rows it ran 1.2-3.2x MLX's product at every 8B and 32B shape
# (docs/performance.md, "The gemm form"). Siblings in one launch (q, k and v; gate and up) run
# it past WIDE_ROWS where their weight rows sum past WIDE_OUTPUTS (a group's gemm blocks take
# the whole input width, so fewer rows would leave the GPU half empty), the tensor-core form
# otherwise.
MMA_ROWS = 64
WIDE_ROWS = 32
WIDE_OUTPUTS = 8192
GEMM_NT = 2
GEMM_WARPS = 8
GEMM_BLOCKS = 320
GEMM_MIN_STEPS = 8
# Rows from which a 4-bit product dequantizes its weight instead (`CudaRows.dense_rows`): the
# prefill's chunks (core/target.py PREFILL_CHUNK), not a verify or a prefix hit's short tail.
DENSE_ROWS = 512
BITS = (4, 8)
THREADS = 128  # 4 warps a block


def rows_per_warp(n: int) -> int:
    """Weight rows a warp takes: more rows share each read of the input across them, fewer
    keep enough warps in flight for a narrow matrix."""
    return 4 if n >= 4096 else 1


def warps(n: int) -> int:
    """Warps of a block of the tensor-core form, splitting the input dimension: more where
    the matrix has few 16-row tiles, so that enough reads are in flight at once. The same at
    every row count, so a row's sum runs in one order whatever the rows beside it; at most 8,
    so the block's scratch (warps x 32 x 4 floats a group of 8 rows) fits 32 KB at MMA_ROWS.
    (Up to 8 rows, matrices of at most 1,024 rows took 16 before: no 8B or 32B product has
    so few, q, k and v running as one launch.)"""
    return 8 if n <= 4096 else 4


def shares(n: int, k: int) -> int:
    """Shares of the input width the gemm form splits a product of `n` weight rows and `k`
    inputs into (KS): enough blocks to fill an H100's 132 SMs about twice over, each share at
    least GEMM_MIN_STEPS steps of 128 inputs. Depends on the shape only, so a row's sum runs in
    one order whatever the rows beside it."""
    blocks, steps, ks = -(-n // (8 * GEMM_NT * GEMM_WARPS)), k // 128, 1
    while blocks * ks * 2 <= GEMM_BLOCKS and steps // (ks * 2) >= GEMM_MIN_STEPS:
        ks *= 2
    return ks


def wide(m: int, n: int) -> bool:
    """Whether a group of siblings in one launch, `m` input rows and `n` weight rows in all,
    runs the gemm form: past WIDE_ROWS rows, where the tensor-core form's rereads of the inputs
    lost to MLX's product on an H100, and past WIDE_OUTPUTS weight rows, enough blocks for a
    form that takes the whole input width."""
    return m > WIDE_ROWS and n > WIDE_OUTPUTS


@dataclass(frozen=True)
class Launch:
    """One product's launch, from its shape alone (no GPU needed): which body
    (`kernel_body(form, count)`, compiled once under `name`), at which template, over which
    grid. `CudaRows` launches these; the nvcc checks (tests/test_cuda_compile.py,
    scripts/kernel_resources.py) compile exactly these templates."""

    name: str
    form: str
    count: int  # matrices in one launch (0: one)
    template: tuple[tuple[str, Any], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    shares: int = 1  # the gemm form's shares of the input width: a `sum_plan` launch adds them


def form_of(width: int, bits: int, dtype: mx.Dtype) -> str:
    """Which form computes a product: mma (tensor cores) or fma (float32, CUDA cores)."""
    half = dtype in (mx.float16, mx.bfloat16)
    return "mma" if bits == 4 and half and width % 128 == 0 else "fma"


def plan(
    m: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    dtype: mx.Dtype,
    form: str | None = None,
    rows: Any = None,
) -> Launch:
    """The launch of x [m, k] @ dequantize(w [n, k]).T. `form` and `rows` (the float32 form's
    weight rows a warp; the gemm form's (weight fragments a warp, warps a block, shares))
    force a choice, for benchmarks and tests."""
    if form is None:
        form = form_of(k, bits, dtype)
        if form == "mma" and m > WIDE_ROWS:
            form = "gemm"
    if form == "gemm":
        nt, kw, ks = rows or (GEMM_NT, GEMM_WARPS, shares(n, k))
        template = (("T", dtype), ("GS", group_size), ("KW", kw), ("MB", -(-m // 16)),
                    ("NT", nt), ("KS", ks))  # fmt: skip
        grid = -(-n // (8 * nt * kw)) * ks * kw * 32
        name = "gemm" if ks == 1 else "gemm_split"
        return Launch(name, name, 0, template, (grid, 1, 1), (kw * 32, 1, 1), ks)
    if form == "mma":
        kw = warps(n)
        template = (("T", dtype), ("GS", group_size), ("KW", kw), ("NB", -(-m // 8)))
        return Launch("mma", "mma", 0, template, (-(-n // 16) * kw * 32, 1, 1), (kw * 32, 1, 1))
    r = rows or rows_per_warp(n)
    template = (("T", dtype), ("M", m), ("R", r), ("BITS", bits), ("GS", group_size))
    return Launch(form, form, 0, template, (-(-n // r) * 32, 1, 1), (THREADS, 1, 1))


def group_plan(m: int, ns: tuple[int, ...], group_size: int, dtype: mx.Dtype) -> Launch:
    """The one launch of x [m, k] by each of several weights of `ns` rows (q, k and v; gate
    and up): the gemm form where `wide`, the tensor-core form otherwise."""
    if wide(m, sum(ns)):
        form, kw, span = "gemm", GEMM_WARPS, 8 * GEMM_NT * GEMM_WARPS
        shape = (("MB", -(-m // 16)), ("NT", GEMM_NT))
    else:
        form, kw, span = "mma", warps(sum(ns)), 16
        shape = (("NB", -(-m // 8)),)
    blocks = sum(-(-n // span) for n in ns)
    name = f"group{len(ns)}" if form == "mma" else f"{form}_group{len(ns)}"
    template = (("T", dtype), ("GS", group_size), ("KW", kw), *shape)
    return Launch(name, form, len(ns), template, (blocks * kw * 32, 1, 1), (kw * 32, 1, 1))


def sum_plan(m: int, n: int, ks: int, dtype: mx.Dtype) -> Launch:
    """The second launch of a product in `ks` shares: their float32 partial sums added in
    order, cast to `dtype`."""
    grid = -(-m * n // THREADS) * THREADS
    return Launch("sum", "sum", 0, (("T", dtype), ("KS", ks)), (grid, 1, 1), (THREADS, 1, 1))


class CudaRows:
    """The kernels as a `core.row_kernels.RowsKernel`: the tensor-core form for 4-bit weights
    and half-precision activations at input widths of whole 128s, the float32 form otherwise.
    Each compiles on first use per template (MLX keeps the result on disk)."""

    name = "cuda-rows"
    # One row keeps MLX's own product: on an H100 its one-row kernel costs the device about
    # what this one does at an 8B's shapes (latency, not reading, bounds the small ones), and
    # each of the 253 calls of a forward through this kernel cost the host ~13 us more, which
    # took plain decoding of a 4-bit 8B from 126 to 102 tok/s (docs/performance.md).
    min_rows = MIN_ROWS
    max_rows = MAX_ROWS

    def __init__(self) -> None:
        self._kernels: dict[str, object] = {}
        # a product's shape and type: its launch, and the launch adding its shares (if any)
        self._launches: dict[tuple, tuple[Launch, Launch | None]] = {}

    def available(self) -> bool:
        return on_cuda_gpu() and hasattr(mx.fast, "cuda_kernel")

    def supports(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """4 or 8 bits in groups of 32 or more (a lane's 16-byte read then lies in one
        group), activations of a floating type."""
        return (
            bits in BITS
            and group_size >= 32
            and width % group_size == 0
            and dtype in (mx.float32, mx.float16, mx.bfloat16)
        )

    def preferred(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """The tensor-core form: a whole 8B 4-bit forward of 2-8 rows, and the oracle's
        rounds at caps 2 and 4, ran faster through it than through MLX's products on an H100
        and an H200 (docs/performance.md). The float32 form has not been, so `auto` keeps
        MLX's there."""
        return (
            self.supports(width, bits, group_size, dtype) and self.form(width, bits, dtype) == "mma"
        )

    form = staticmethod(form_of)

    def rows_up_to(
        self, width: int, outputs: int, bits: int, group_size: int, dtype: mx.Dtype
    ) -> int:
        """The half-precision forms take up to MMA_ROWS rows (the tensor-core form up to
        WIDE_ROWS, the gemm form past it), the float32 form MAX_ROWS."""
        if self.form(width, bits, dtype) != "mma":
            return MAX_ROWS
        return MMA_ROWS

    def dense_rows(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> int | None:
        """From how many rows a product of the tensor-core form's shapes runs faster as the
        weight dequantized and multiplied in half precision than as MLX 0.32's quantized
        product: from DENSE_ROWS (a prefill chunk), where every 8B and 32B projection did on
        an H100, 1.7-3.1x; at 128 rows some did not (docs/performance.md, "Prefill of
        quantized targets")."""
        return DENSE_ROWS if self.preferred(width, bits, group_size, dtype) else None

    def groups(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """Whether `grouped` computes several products of this shape in one launch: the
        tensor-core form's."""
        return (
            self.supports(width, bits, group_size, dtype) and self.form(width, bits, dtype) == "mma"
        )

    def grouped(
        self,
        x: mx.array,
        weights: list[tuple[mx.array, mx.array, mx.array]],
        group_size: int,
        bits: int,
    ) -> list[mx.array]:
        """x @ dequantize(w).T for each (w, scales, biases) of `weights` (one input width, the
        tensor-core form's shapes), in one launch."""
        lead = x.shape[:-1]
        ns = tuple(w.shape[0] for w, _, _ in weights)
        key = ("group", lead, ns, x.shape[-1], group_size, x.dtype)
        if key not in self._launches:
            self._launches[key] = (group_plan(math.prod(lead), ns, group_size, x.dtype), None)
        launch, _ = self._launches[key]
        return self._compiled(launch)(
            inputs=[x, *(a for triple in weights for a in triple)],
            template=list(launch.template),
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            output_shapes=[(*lead, n) for n in ns],
            output_dtypes=[x.dtype] * len(ns),
        )

    def _compiled(self, launch: Launch):
        """The kernel of `launch`'s body, built once (MLX compiles it on first use)."""
        if launch.name not in self._kernels:
            header, source, inputs, outputs = kernel_body(launch.form, launch.count)
            self._kernels[launch.name] = mx.fast.cuda_kernel(
                f"outrider_quantized_rows_{launch.name}_v{VERSION}",
                input_names=[arg for arg, _ in inputs],
                output_names=[arg for arg, _ in outputs],
                source=source,
                header=header,
            )
        return self._kernels[launch.name]

    def __call__(
        self,
        x: mx.array,
        w: mx.array,
        scales: mx.array,
        biases: mx.array,
        group_size: int,
        bits: int,
        form: str | None = None,
        rows: int | None = None,
    ) -> mx.array:
        """x @ dequantize(w).T for x [..., K] of at most `rows_up_to` rows. `form` and `rows` (the
        float32 form's weight rows a warp; the gemm form's (weight fragments a warp, warps a
        block, shares)) force a choice, for benchmarks and tests."""
        lead, k = x.shape[:-1], x.shape[-1]
        m = math.prod(lead)
        n = w.shape[0]
        key = (form, m, n, k, bits, group_size, x.dtype, rows)
        if key not in self._launches:  # its launch, and the sum of its shares where it has any
            launch = plan(m, n, k, bits, group_size, x.dtype, form, rows)
            total = sum_plan(m, n, launch.shares, x.dtype) if launch.shares > 1 else None
            self._launches[key] = (launch, total)
        launch, total = self._launches[key]
        ks = launch.shares
        y = self._compiled(launch)(  # x as it comes (contiguous): no reshape ops around the call
            inputs=[x, w, scales, biases],
            template=list(launch.template),
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            output_shapes=[(*lead, n) if ks == 1 else (ks, *lead, n)],
            output_dtypes=[x.dtype if ks == 1 else mx.float32],
        )[0]
        if total is None:
            return y
        return self._compiled(total)(  # the shares' partial sums, added in order
            inputs=[y],
            template=list(total.template),
            grid=total.grid,
            threadgroup=total.threadgroup,
            output_shapes=[(*lead, n)],
            output_dtypes=[x.dtype],
        )[0]


@hookimpl
def register_matmul_kernels(register):
    register(CudaRows())
