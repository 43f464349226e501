"""The CUDA rows kernel itself (plugins/kernels/cuda_rows.py): which form and launch it picks
for a product's shape, checked on any machine (MLX's `cuda_kernel` recorded where it cannot
run), and where a CUDA GPU runs the suite, each form's products against MLX's, each row as
it is alone. What stands around a kernel (which products reach it, the probe, the setting) is
tests/test_row_kernels.py's, with a kernel written in MLX's ops.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import outrider
from outrider.core import row_kernels
from outrider.core.device import on_cuda_gpu
from outrider.core.plugins import Plugins
from outrider.plugins.kernels import cuda_rows


def test_the_cuda_kernel_dequantizes_prefill_chunks_only_at_its_measured_form():
    cuda = cuda_rows.CudaRows()
    assert cuda.dense_rows(4096, 4, 64, mx.bfloat16) == cuda_rows.DENSE_ROWS
    assert cuda.dense_rows(4096, 8, 64, mx.bfloat16) is None  # 8 bits: not measured
    assert cuda.dense_rows(4096, 4, 64, mx.float32) is None
    assert cuda.rows_up_to(4096, 4096, 4, 64, mx.bfloat16) == cuda_rows.MMA_ROWS  # tensor cores
    assert cuda.rows_up_to(4096, 12288, 4, 64, mx.bfloat16) == cuda_rows.MMA_ROWS  # gemm form
    assert cuda.rows_up_to(4096, 4096, 8, 64, mx.bfloat16) == cuda_rows.MAX_ROWS
    assert cuda_rows.MMA_ROWS <= cuda_rows.DENSE_ROWS
    # the block scratch of the most rows fits MLX's static shared memory (48 KB)
    for n in (256, 4096, 25600):
        assert 512 * cuda_rows.warps(n) * (cuda_rows.MMA_ROWS // 8) <= 32 * 1024
    assert cuda_rows.DENSE_ROWS <= outrider.core.target.PREFILL_CHUNK  # chunks reach it
    # the gemm form's two buffers of staged inputs (64 rows x 128 columns, bf16) fit too, and
    # groups run it past WIDE_ROWS only where their weight rows fill the GPU
    assert 2 * cuda_rows.MMA_ROWS * 128 * 2 <= 48 * 1024
    assert cuda_rows.wide(cuda_rows.WIDE_ROWS + 1, cuda_rows.WIDE_OUTPUTS + 1)
    assert not cuda_rows.wide(cuda_rows.WIDE_ROWS, 25600)
    assert not cuda_rows.wide(64, cuda_rows.WIDE_OUTPUTS)


class RecordedKernels:
    """`mx.fast.cuda_kernel` as a recorder: each call's kernel name, template, grid and output
    shapes, answered with zeros (no GPU here)."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, **_):
        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls.append((name, dict(template), grid[0], output_shapes, output_dtypes))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return launch


def test_products_past_wide_rows_run_the_gemm_form_in_shares_of_the_input_width(monkeypatch):
    """Up to WIDE_ROWS rows the tensor-core form; past it the gemm form, whose input width goes
    in shares (added in order by a second launch) where the weight has too few rows to fill
    the GPU: the shares depend on the weight's shape only, so a row's sum runs in one order at
    every row count."""
    recorded = RecordedKernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", recorded, raising=False)
    kernel = cuda_rows.CudaRows()
    n, k = 1024, 8192  # 8 blocks of 128 weight rows, 64 steps of 128 inputs
    w = mx.zeros((n, k // 8), mx.uint32)
    s = b = mx.zeros((n, k // 64), mx.bfloat16)
    ks = cuda_rows.shares(n, k)
    assert ks == 8  # 64 blocks; 8 steps a share
    for rows in (cuda_rows.WIDE_ROWS, cuda_rows.WIDE_ROWS + 1, 1, cuda_rows.MMA_ROWS):
        recorded.calls.clear()
        y = kernel(mx.zeros((rows, k), mx.bfloat16), w, s, b, 64, 4, form=None)
        assert y.shape == (rows, n) and y.dtype == mx.bfloat16
        names = [call[0].split("_v")[0] for call in recorded.calls]
        if rows <= cuda_rows.WIDE_ROWS:
            assert names == ["outrider_quantized_rows_mma"]
            continue
        assert names == ["outrider_quantized_rows_gemm_split", "outrider_quantized_rows_sum"]
        (_, gemm, grid, shapes, dtypes), (_, summed, _, out, _) = recorded.calls
        assert gemm["KS"] == summed["KS"] == ks and gemm["MB"] == -(-rows // 16)
        assert grid == 8 * ks * cuda_rows.GEMM_WARPS * 32  # a block a share of 128 weight rows
        assert shapes == [(ks, rows, n)] and dtypes == [mx.float32] and out == [(rows, n)]
    # a weight with rows enough takes its input width whole, in one launch
    assert cuda_rows.shares(25600, 5120) == 1
    assert cuda_rows.shares(1024, 1024) == 1  # 8 steps: too few to split
    assert cuda_rows.shares(5120, 25600) == 8


def test_siblings_run_in_one_launch_the_gemm_form_only_past_wide_rows_and_outputs(monkeypatch):
    """q, k and v (or gate and up) in one launch: the tensor-core form, or past WIDE_ROWS rows
    where their weight rows sum past WIDE_OUTPUTS the gemm form (its blocks take the whole
    input width); the grid is each matrix's blocks laid end to end, and each member gets its
    own output."""
    recorded = RecordedKernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", recorded, raising=False)
    kernel = cuda_rows.CudaRows()
    k = 1024

    def weights(ns):
        return [(mx.zeros((n, k // 8), mx.uint32), *[mx.zeros((n, k // 64), mx.bfloat16)] * 2)
                for n in ns]  # fmt: skip

    cases = [  # rows, weight rows of each member, the kernel, blocks a member
        (cuda_rows.WIDE_ROWS, (8192, 1024), "group2", lambda n: -(-n // 16)),
        (cuda_rows.WIDE_ROWS + 1, (8192, 1024), "gemm_group2", lambda n: -(-n // 128)),
        (cuda_rows.MMA_ROWS, (4096, 2048, 2048), "group3", lambda n: -(-n // 16)),  # 8,192
    ]
    for rows, ns, name, blocks in cases:
        recorded.calls.clear()
        out = kernel.grouped(mx.zeros((rows, k), mx.bfloat16), weights(ns), 64, 4)
        assert [y.shape for y in out] == [(rows, n) for n in ns]
        ((called, template, grid, shapes, _),) = recorded.calls
        assert called.split("_v")[0] == f"outrider_quantized_rows_{name}"
        warps = template["KW"]
        assert grid == sum(blocks(n) for n in ns) * warps * 32
        if name.startswith("gemm"):
            assert template["MB"] == -(-rows // 16) and warps == cuda_rows.GEMM_WARPS
        else:
            assert template["NB"] == -(-rows // 8) and warps == cuda_rows.warps(sum(ns))
        plan = cuda_rows.group_plan(rows, ns, 64, mx.bfloat16)  # what the nvcc checks compile
        assert (plan.name, dict(plan.template), plan.grid[0]) == (name, template, grid)


def test_the_cuda_kernel_is_a_builtin_plugin_that_says_where_it_runs():
    kernels = Plugins(load_entrypoints=False).kernels
    assert isinstance(kernels["cuda-rows"], cuda_rows.CudaRows)
    cuda = kernels["cuda-rows"]
    assert cuda.available() == on_cuda_gpu()
    assert cuda.supports(4096, 4, 64, mx.bfloat16) and cuda.supports(2560, 8, 128, mx.float32)
    assert not cuda.supports(4096, 3, 64, mx.bfloat16)  # 3 bits: MLX's own
    assert not cuda.supports(4096, 4, 16, mx.bfloat16)  # groups under 32 straddle a lane's read
    assert not cuda.supports(48, 4, 16, mx.float32)
    assert not cuda.supports(4096, 4, 64, mx.int32)
    assert cuda.supports(96, 4, 32, mx.float32)  # three groups: less than one step of a warp


@pytest.mark.skipif(not on_cuda_gpu(), reason="the CUDA kernel runs on a CUDA GPU only")
@pytest.mark.parametrize(
    "form,dtype,bits,group,n,k",
    [
        ("mma", mx.bfloat16, 4, 64, 1000, 1024),
        ("mma", mx.bfloat16, 4, 32, 300, 2560),
        ("mma", mx.float16, 4, 128, 4096, 1024),
        ("gemm", mx.bfloat16, 4, 64, 1000, 1024),
        ("gemm", mx.bfloat16, 4, 64, 1000, 4096),  # in 4 shares of the input width, summed
        ("gemm", mx.float16, 4, 128, 4096, 1024),  # half, groups of 128: what auto gives past 32
        ("fma", mx.bfloat16, 4, 64, 1000, 1024),
        ("fma", mx.float32, 8, 64, 257, 2048),
    ],
)
def test_the_cuda_kernel_computes_mlxs_product_and_each_row_as_alone(
    form, dtype, bits, group, n, k
):
    kernel = cuda_rows.CudaRows()
    assert form == "fma" or kernel.form(k, bits, dtype) == "mma"
    w = mx.random.normal((n, k), key=mx.random.key(0)).astype(dtype) * 0.05
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    top = kernel.rows_up_to(k, n, bits, group, dtype) if form != "fma" else 8
    x = mx.random.normal((top, k), key=mx.random.key(1)).astype(dtype)
    alone = kernel(x[:1], wq, s, b, group, bits, form=form)
    tolerance = row_kernels.PROBE_TOLERANCE[dtype]
    # the tensor-core form takes rows in groups of 8: one group, several, a part-filled last.
    # Each count of groups compiles its own template (tens of seconds on a GPU), so the first
    # case alone runs a second group part-filled (9 rows)
    counts = {1, 2, 5, 8, 9, top} if (n, k) == (1000, 1024) else {1, 5, 8, top}
    if form == "gemm":  # rows past WIDE_ROWS, and one row to hold them to
        counts = {1, 33, top}
    for rows in sorted(counts & set(range(1, top + 1))):
        got = kernel(x[:rows], wq, s, b, group, bits, form=form).astype(mx.float32)
        want = mx.quantized_matmul(x[:rows], wq, s, b, True, group, bits).astype(mx.float32)
        assert (mx.abs(got - want).max() / mx.abs(want).max()).item() <= tolerance
        assert mx.array_equal(got[:1], alone.astype(mx.float32)).item()


@pytest.mark.parametrize(
    "k,bits,group,dtype,want",
    [
        (4096, 4, 64, mx.bfloat16, True),  # the tensor-core form: measured faster than MLX's
        (4096, 4, 128, mx.float16, True),
        (4096, 8, 64, mx.bfloat16, False),  # the float32 form: not measured faster
        (4096, 4, 64, mx.float32, False),
        (4160, 4, 64, mx.bfloat16, False),  # not a whole number of 128s
        (4096, 4, 16, mx.bfloat16, False),  # a group it does not take at all
    ],
)
def test_auto_takes_the_cuda_kernel_where_its_form_was_measured_faster(k, bits, group, dtype, want):
    assert cuda_rows.CudaRows().preferred(k, bits, group, dtype) is want


@pytest.mark.skipif(not on_cuda_gpu(), reason="the CUDA kernel runs on a CUDA GPU only")
@pytest.mark.parametrize(
    "dtype,group,ns,k",
    [
        (mx.bfloat16, 64, (4096, 1024, 1024), 4096),  # an 8B's q, k and v
        (mx.float16, 128, (300, 1000), 1024),  # rows that do not fill the last tile
    ],
)
def test_the_cuda_kernels_grouped_form_computes_each_members_product(dtype, group, ns, k):
    kernel = cuda_rows.CudaRows()
    assert kernel.groups(k, 4, group, dtype)
    weights = []
    for i, n in enumerate(ns):
        w = mx.random.normal((n, k), key=mx.random.key(10 + i)).astype(dtype) * 0.05
        weights.append(mx.quantize(w, group_size=group, bits=4))
    x = mx.random.normal((cuda_rows.MMA_ROWS, k), key=mx.random.key(1)).astype(dtype)
    alone = kernel.grouped(x[:1], weights, group, 4)
    tolerance = row_kernels.PROBE_TOLERANCE[dtype]
    for rows in (1, 2, 5, 8, cuda_rows.MMA_ROWS):  # one group, and every group (a template each)
        got = kernel.grouped(x[:rows], weights, group, 4)
        for y, first, (w, s, b) in zip(got, alone, weights, strict=True):
            want = mx.quantized_matmul(x[:rows], w, s, b, True, group, 4).astype(mx.float32)
            y = y.astype(mx.float32)
            assert y.shape == want.shape
            assert (mx.abs(y - want).max() / mx.abs(want).max()).item() <= tolerance
            assert mx.array_equal(y[:1], first.astype(mx.float32)).item()
