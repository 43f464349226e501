"""Compile a CUDA kernel body the way `mx.fast.cuda_kernel` wraps it, with the CUDA toolkit's
`nvcc`, on a machine without a GPU: a kernel's source errors, and its registers, spills and
shared memory per template, show before any device time is spent on it.

The wrapper declares what MLX hands a kernel body (each input `name`, `name_shape` and
`name_ndim`; each output) close enough to compile the same body; MLX's own NVRTC build of it on
a GPU is the one that runs. Used by `scripts/kernel_resources.py` and the rows kernel's tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PRELUDE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"
TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float", "uint32": "uint32_t"}


@dataclass
class Resources:
    """What ptxas reports for one instantiation."""

    name: str
    registers: int
    spill_bytes: int  # stores plus loads
    shared_bytes: int


def nvcc() -> str | None:
    """The toolkit's compiler, if this machine has one."""
    return shutil.which("nvcc")


def instantiate(
    name: str,
    header: str,
    source: str,
    inputs: list[tuple[str, str]],
    outputs: list[tuple[str, str]],
    template: list[tuple[str, str | int]],
) -> str:
    """The translation unit of one kernel at one template: `inputs` and `outputs` are (name,
    type) pairs, a type being a key of TYPES or a template parameter's name; `template` gives
    each template parameter (a type name as in TYPES, or an integer)."""
    concrete = {p: _type(v) for p, v in template if isinstance(v, str)}

    def actual(kind: str) -> str:
        return concrete.get(kind, _type(kind))

    params = []  # (the type as the template declares it, at this template, the name)
    for arg, kind in inputs:
        params += [
            (f"const {_type(kind)}*", f"const {actual(kind)}*", arg),
            ("const int*", "const int*", f"{arg}_shape"),
            ("int", "int", f"{arg}_ndim"),
        ]
    params += [(f"{_type(kind)}*", f"{actual(kind)}*", arg) for arg, kind in outputs]
    heads = [f"typename {p}" if isinstance(v, str) else f"int {p}" for p, v in template]
    args = [_type(v) if isinstance(v, str) else str(v) for _, v in template]
    declared = ", ".join(f"{generic} {arg}" for generic, _, arg in params)
    body = f"template <{', '.join(heads)}>\n__global__ void {name}({declared}) {{\n{source}\n}}\n"
    signature = ", ".join(at for _, at, _ in params)
    inst = f"template __global__ void {name}<{', '.join(args)}>({signature});\n"
    return PRELUDE + header + "\n" + body + inst


def compile_report(units: list[str], arch: str = "sm_90") -> list[Resources]:
    """Compile each translation unit with nvcc for `arch` and read ptxas's report. Raises
    RuntimeError with the compiler's message when one does not compile."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("no nvcc on this machine (the CUDA toolkit compiles these)")
    out: list[Resources] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, unit in enumerate(units):
            path = Path(tmp) / f"k{i}.cu"
            path.write_text(unit)
            run = subprocess.run(
                [compiler, f"-arch={arch}", "-std=c++17", "--resource-usage", "-c", str(path),
                 "-o", str(path.with_suffix(".o"))],
                capture_output=True, text=True,
            )  # fmt: skip
            if run.returncode:
                raise RuntimeError(f"nvcc failed on unit {i}:\n{run.stderr[-4000:]}")
            out += parse_report(run.stdout + run.stderr)
    return out


def launch_unit(launch, name: str | None = None) -> str:
    """The translation unit of one rows-kernel launch as `cuda_rows.plan` (or `group_plan`,
    `sum_plan`) works it out: its body at its template, so what compiles here is what the
    kernel launches."""
    from ..plugins.kernels.cuda_rows_code import kernel_body

    template = [
        (p, v if isinstance(v, int) else str(v).rsplit(".", 1)[-1]) for p, v in launch.template
    ]
    body = kernel_body(launch.form, launch.count)
    return instantiate(name or f"rows_{launch.name}", *body, template)


def _type(kind: str) -> str:
    return TYPES.get(kind, kind)


def parse_report(text: str) -> list[Resources]:
    """Each entry function's resources, as ptxas's --resource-usage report prints them."""
    found: list[Resources] = []
    name = ""
    spills = 0
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name, spills = m.group(1), 0
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = int(m.group(1)) + int(m.group(2))
        elif m := re.search(r"Used (\d+) registers", line):
            smem = re.search(r"(\d+) bytes smem", line)
            found.append(
                Resources(name, int(m.group(1)), spills, int(smem.group(1)) if smem else 0)
            )
    return found
