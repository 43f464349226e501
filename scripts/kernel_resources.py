"""Registers, spills and shared memory of the rows kernel's CUDA forms at every template it
launches, compiled with the CUDA toolkit's nvcc on this machine (no GPU needed): run it after
changing a kernel and before spending device time on it. A template that spills registers runs
at a fraction of its speed; MLX's static shared memory is 48 KB.

    python scripts/kernel_resources.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from outrider.plugins.kernels import cuda_rows  # noqa: E402
from outrider.testing import cuda_compile  # noqa: E402


def units() -> list[tuple[str, str]]:
    """(what, translation unit) of each form at each template it launches, as `cuda_rows.plan`
    works the launches out."""
    out = []
    for dtype in (mx.bfloat16, mx.float32):
        for bits in cuda_rows.BITS:
            for n, r in ((1024, 1), (4096, 4)):  # weight rows a warp, as rows_per_warp picks
                for m in range(cuda_rows.MIN_ROWS, cuda_rows.MAX_ROWS + 1):
                    launch = cuda_rows.plan(m, n, n, bits, 64, dtype, "fma")
                    short = str(dtype).rsplit(".", 1)[-1]
                    out.append((f"fma {short} {bits}-bit, {r} weight rows a warp, {m} rows",
                                cuda_compile.launch_unit(launch)))  # fmt: skip
    for n, kw in ((4096, 8), (25600, 4)):  # warps a block, as warps() picks
        for nb in range(1, cuda_rows.MMA_ROWS // 8 + 1):
            launch = cuda_rows.plan(8 * nb, n, 5120, 4, 64, mx.bfloat16, "mma")
            out.append((f"mma bf16, {kw} warps, {8 * nb} rows", cuda_compile.launch_unit(launch)))
    for mb in range(3, cuda_rows.MMA_ROWS // 16 + 1):
        for n, k in ((25600, 5120), (5120, 25600)):  # whole width; in shares
            launch = cuda_rows.plan(16 * mb, n, k, 4, 64, mx.bfloat16)
            out.append((f"gemm bf16, {cuda_rows.GEMM_NT} fragments a warp, {16 * mb} rows, "
                        f"{launch.shares} shares", cuda_compile.launch_unit(launch)))  # fmt: skip
    launch = cuda_rows.group_plan(cuda_rows.MMA_ROWS, (25600, 25600), 64, mx.bfloat16)
    out.append(("gemm bf16, two matrices in one launch, 64 rows", cuda_compile.launch_unit(launch)))
    launch = cuda_rows.group_plan(cuda_rows.WIDE_ROWS, (4096, 1024, 1024), 64, mx.bfloat16)
    out.append(
        ("mma bf16, three matrices in one launch, 32 rows", cuda_compile.launch_unit(launch))
    )
    launch = cuda_rows.sum_plan(cuda_rows.MMA_ROWS, 5120, 8, mx.bfloat16)
    out.append(("sum of 8 shares", cuda_compile.launch_unit(launch)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    if cuda_compile.nvcc() is None:
        sys.exit("kernel_resources.py: no nvcc on this machine (install the CUDA toolkit)")
    made = units()
    report = cuda_compile.compile_report([u for _, u in made], args.arch)
    print(f"{'template':<52} {'registers':>9} {'spilled B':>9} {'shared B':>9}")
    for (what, _), kernel in zip(made, report):
        flag = "  SPILLS" if kernel.spill_bytes else ""
        print(f"{what:<52} {kernel.registers:>9} {kernel.spill_bytes:>9} "
              f"{kernel.shared_bytes:>9}{flag}")  # fmt: skip


if __name__ == "__main__":
    main()
