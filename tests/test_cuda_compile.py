"""outrider's CUDA kernel sources compiled with the CUDA toolkit's nvcc on a machine without a
GPU (`outrider.testing.cuda_compile`): a source error shows here, not in a device call, and so
does a template that spills registers (a kernel that then runs at a fraction of its speed) or
outgrows MLX's static shared memory (48 KB). MLX's own NVRTC build on a GPU is the one that
runs: this checks the source and its resources, not its results (tests/test_cuda_rows.py
does, on a GPU)."""

from __future__ import annotations

import pytest

from outrider.plugins.kernels import cuda_rows
from outrider.testing import cuda_compile

pytestmark = pytest.mark.skipif(
    cuda_compile.nvcc() is None, reason="no CUDA toolkit (nvcc) on this machine"
)


@pytest.mark.slow  # one nvcc build a template, a few seconds each
def test_the_rows_kernels_compile_without_spilling_registers():
    """The rows kernel's forms at templates it launches with the most rows, for an H100 / H200
    (sm_90)."""
    widest = cuda_rows.MMA_ROWS // 8
    units = [
        cuda_compile.instantiate(
            "rows_fma",
            *cuda_rows.kernel_body("fma"),
            [("T", t), ("M", cuda_rows.MAX_ROWS), ("R", r), ("BITS", bits), ("GS", 64)],
        )  # fmt: skip
        for t, r, bits in (("bfloat16", 4, 4), ("float32", 4, 8), ("float16", 1, 4))
    ]
    units += [
        cuda_compile.instantiate(
            "rows_mma",
            *cuda_rows.kernel_body("mma"),
            [("T", t), ("GS", 64), ("KW", cuda_rows.warps(n)), ("NB", nb)],
        )  # fmt: skip
        for t, n, nb in (
            ("bfloat16", 25600, widest),
            ("float16", 4096, widest),
            ("bfloat16", 1024, 1),
        )
    ]
    units.append(
        cuda_compile.instantiate(
            "rows_group3",
            *cuda_rows.kernel_body("mma", 3),
            [("T", "bfloat16"), ("GS", 64), ("KW", cuda_rows.warps(6144)), ("NB", widest)],
        )  # fmt: skip
    )
    # past WIDE_ROWS: the gemm form over the whole input width, in shares, and grouped
    gemm = [("KW", cuda_rows.GEMM_WARPS), ("MB", cuda_rows.MMA_ROWS // 16),
            ("NT", cuda_rows.GEMM_NT)]  # fmt: skip
    units += [
        cuda_compile.instantiate(
            name, *cuda_rows.kernel_body(form, count), [("T", t), ("GS", 64), *shape]
        )  # fmt: skip
        for name, form, count, t, shape in (
            ("rows_gemm", "gemm", 0, "bfloat16", [*gemm, ("KS", 1)]),
            ("rows_gemm_split", "gemm_split", 0, "bfloat16", [*gemm, ("KS", 8)]),
            ("rows_gemm_half", "gemm_split", 0, "float16", [*gemm, ("KS", 4)]),
            ("rows_gemm2", "gemm", 2, "bfloat16", gemm),
        )
    ]
    units.append(
        cuda_compile.instantiate(
            "rows_sum", *cuda_rows.kernel_body("sum"), [("T", "bfloat16"), ("KS", 8)]
        )
    )
    report = cuda_compile.compile_report(units)
    assert len(report) == len(units)
    for kernel in report:
        assert kernel.spill_bytes == 0, kernel
        assert kernel.shared_bytes <= 48 * 1024, kernel


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
