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

from outrider.plugins.kernels import cuda_rows  # noqa: E402
from outrider.testing import cuda_compile  # noqa: E402


def units() -> list[tuple[str, str]]:
    """(what, translation unit) of each form at each template it launches."""
    out = []
    for t in ("bfloat16", "float32"):
        for bits in cuda_rows.BITS:
            for r in (1, 4):
                for m in range(cuda_rows.MIN_ROWS, cuda_rows.MAX_ROWS + 1):
                    template = [("T", t), ("M", m), ("R", r), ("BITS", bits), ("GS", 64)]
                    unit = cuda_compile.instantiate(
                        "rows_fma", *cuda_rows.kernel_body("fma"), template
                    )
                    out.append((f"fma {t} {bits}-bit, {r} weight rows a warp, {m} rows", unit))
    for kw in (4, 8):
        for nb in range(1, cuda_rows.MMA_ROWS // 8 + 1):
            template = [("T", "bfloat16"), ("GS", 64), ("KW", kw), ("NB", nb)]
            unit = cuda_compile.instantiate("rows_mma", *cuda_rows.kernel_body("mma"), template)
            out.append((f"mma bf16, {kw} warps, {8 * nb} rows", unit))
    for mb in range(3, cuda_rows.MMA_ROWS // 16 + 1):
        for ks in (1, 8):
            form = "gemm" if ks == 1 else "gemm_split"
            template = [("T", "bfloat16"), ("GS", 64), ("KW", cuda_rows.GEMM_WARPS), ("MB", mb),
                        ("NT", cuda_rows.GEMM_NT), ("KS", ks)]  # fmt: skip
            unit = cuda_compile.instantiate("rows_gemm", *cuda_rows.kernel_body(form), template)
            out.append((f"gemm bf16, {cuda_rows.GEMM_NT} fragments a warp, {16 * mb} rows, "
                        f"{ks} shares", unit))  # fmt: skip
    template = [("T", "bfloat16"), ("GS", 64), ("KW", cuda_rows.GEMM_WARPS), ("MB", 4),
                ("NT", cuda_rows.GEMM_NT)]  # fmt: skip
    unit = cuda_compile.instantiate("rows_gemm2", *cuda_rows.kernel_body("gemm", 2), template)
    out.append(("gemm bf16, two matrices in one launch, 64 rows", unit))
    unit = cuda_compile.instantiate(
        "rows_sum", *cuda_rows.kernel_body("sum"), [("T", "bfloat16"), ("KS", 8)]
    )
    out.append(("sum of 8 shares", unit))
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
