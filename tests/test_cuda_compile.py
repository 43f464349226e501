"""outrider's CUDA kernel sources compiled with the CUDA toolkit's nvcc on a machine without a
GPU (`outrider.testing.cuda_compile`): a source error shows here, not in a device call, and so
does a template that spills registers (a kernel that then runs at a fraction of its speed) or
outgrows MLX's static shared memory (48 KB). MLX's own NVRTC build on a GPU is the one that
runs: this checks the source and its resources, not its results (tests/test_cuda_rows.py
does, on a GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from outrider.plugins.kernels.cuda_rows import MAX_ROWS, MMA_ROWS, group_plan, plan, sum_plan
from outrider.testing import cuda_compile

needs_nvcc = pytest.mark.skipif(
    cuda_compile.nvcc() is None, reason="no CUDA toolkit (nvcc) on this machine"
)

# Launches as the rows kernel plans them (cuda_rows.plan), at the most rows each form takes:
# (m rows, n weight rows, k inputs, bits, group size, dtype, forced form)
SINGLE = [
    (MAX_ROWS, 4096, 4096, 4, 64, mx.bfloat16, "fma"),  # 4 weight rows a warp
    (MAX_ROWS, 4096, 4096, 8, 64, mx.float32, None),  # float32: the fma form
    (MAX_ROWS, 1024, 1024, 4, 64, mx.float16, "fma"),  # 1 weight row a warp
    (8, 1024, 1024, 4, 64, mx.bfloat16, None),  # tensor cores, 8 warps, one group of 8 rows
    (MMA_ROWS, 25600, 5120, 4, 64, mx.bfloat16, "mma"),  # as benchmarks force it at 64 rows
    (MMA_ROWS, 4096, 4096, 4, 64, mx.float16, "mma"),
    (MMA_ROWS, 25600, 5120, 4, 64, mx.bfloat16, None),  # 32B gate/up: gemm, whole width
    (MMA_ROWS, 5120, 25600, 4, 64, mx.bfloat16, None),  # 32B down: gemm in 8 shares
    (MMA_ROWS, 5120, 5120, 4, 128, mx.float16, None),  # 32B q/o in half: 4 shares, groups of 128
]


def launches() -> list:
    out = [plan(m, n, k, bits, gs, dtype, form) for m, n, k, bits, gs, dtype, form in SINGLE]
    out.append(group_plan(MMA_ROWS, (4096, 1024, 1024), 64, mx.bfloat16))  # 8B q/k/v: mma
    out.append(group_plan(MMA_ROWS, (25600, 25600), 64, mx.bfloat16))  # 32B gate/up: gemm
    out.append(sum_plan(MMA_ROWS, 5120, 8, mx.bfloat16))
    return out


def test_the_planned_launches_cover_every_form():
    """The list above reaches each body the kernel has (no GPU or nvcc needed for this)."""
    names = {launch.name for launch in launches()}
    assert names == {"fma", "mma", "gemm", "gemm_split", "group3", "gemm_group2", "sum"}
    assert [p.shares for p in launches()[6:9]] == [1, 8, 4]


@needs_nvcc
@pytest.mark.slow  # one nvcc build a template, a few seconds each
def test_the_rows_kernels_compile_without_spilling_registers():
    """Each planned launch's template compiles for an H100 / H200 (sm_90) without spilling,
    within MLX's static shared memory."""
    made = launches()
    units = [cuda_compile.launch_unit(launch, f"rows_{i}") for i, launch in enumerate(made)]
    report = cuda_compile.compile_report(units)
    assert len(report) == len(units)
    for launch, kernel in zip(made, report):
        assert kernel.spill_bytes == 0, (launch, kernel)
        assert kernel.shared_bytes <= 48 * 1024, (launch, kernel)


@needs_nvcc
def test_a_source_error_is_nvccs_message_and_a_spill_is_counted():
    """The helper itself: a body that does not compile raises with the compiler's words, and
    ptxas's report of a spilling kernel reads as spilled (the text as ptxas prints it)."""
    bad = cuda_compile.instantiate("bad", "", "not cuda;", [("x", "T")], [("y", "T")],
                                   [("T", "float32")])  # fmt: skip
    with pytest.raises(RuntimeError, match="nvcc failed"):
        cuda_compile.compile_report([bad])
    report = cuda_compile.parse_report(
        "ptxas info    : Compiling entry function '_Z1k' for 'sm_90'\n"
        "    72 bytes stack frame, 72 bytes spill stores, 72 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 32768 bytes smem\n"
    )
    assert [(k.name, k.registers, k.spill_bytes, k.shared_bytes) for k in report] == [
        ("_Z1k", 255, 144, 32768)
    ]
