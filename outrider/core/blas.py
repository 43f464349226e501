"""Which BLAS MLX's CPU backend multiplies float matrices with.

MLX's Linux CPU wheel (`mlx[cpu]`) links the reference BLAS it bundles, which multiplies at a
few GFLOP/s: on a 2-core x86 machine a float32 [64, 576] x [576, 1536] product takes ~25 ms
there against under 1 ms in OpenBLAS. libmlx takes `cblas_sgemm` from whatever library in the
process's global symbol scope defines it first, so an optimized BLAS loaded with RTLD_GLOBAL
before `mlx.core` is imported is the one MLX calls (the dynamic linker's ordinary lookup, the
same thing LD_PRELOAD does; nothing of MLX is patched).

`preload` runs once, from `outrider/__init__.py`, before anything imports MLX. It looks for,
in order: the library named by OUTRIDER_BLAS (a path; `reference` keeps MLX's own), the
system's OpenBLAS (Debian/Ubuntu `libopenblas0`, Fedora `openblas`), the OpenBLAS of the
`cmeel-openblas` wheel. Only Linux: macOS builds of MLX use Accelerate.

Which token a greedy step picks can depend on the BLAS only through floating-point rounding;
outrider compares every mode with plain decoding in the same process, so both use the same one.
"""

from __future__ import annotations

import ctypes
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

BLAS_ENV = "OUTRIDER_BLAS"


@dataclass
class BlasState:
    """What `preload` did: `path` is the library MLX multiplies with ('' for its own)."""

    path: str = ""
    note: str = ""

    @property
    def optimized(self) -> bool:
        return bool(self.path)

    def as_dict(self) -> dict[str, str | bool]:
        return {"optimized": self.optimized, "path": self.path, "note": self.note}


NOT_FOUND = "no OpenBLAS found: MLX's CPU backend uses its reference BLAS"

_STATE: BlasState | None = None  # one per process, as the dynamic linker's choice is


def candidates() -> list[str]:
    """Libraries to try, best first (OUTRIDER_BLAS alone when it names one)."""
    chosen = os.environ.get(BLAS_ENV, "").strip()
    if chosen:
        return [chosen]
    # by soname (the dynamic loader's own search, no subprocess: this runs at every import)
    return [
        "libopenblas.so.0",
        "libopenblas.so",
        str(Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib" / "libopenblas.so.0"),
    ]


def preload() -> BlasState:
    """Load an optimized BLAS into the global symbol scope for MLX's CPU backend, if one is
    installed and MLX is not imported yet. Never raises: the reference BLAS still works."""
    global _STATE
    if _STATE is not None:
        return _STATE
    if not sys.platform.startswith("linux"):
        _STATE = BlasState(note="not Linux: MLX uses its platform's BLAS")
    elif "mlx.core" in sys.modules:
        _STATE = BlasState(note="MLX was imported before outrider: it keeps its bundled BLAS")
    elif os.environ.get(BLAS_ENV, "").strip().lower() == "reference":
        _STATE = BlasState(note=f"{BLAS_ENV}=reference")
    else:
        _STATE = BlasState(note=NOT_FOUND)
        errors = []
        for name in candidates():
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                lib.cblas_sgemm  # noqa: B018 - a BLAS without CBLAS would not be used
            except (OSError, AttributeError) as e:
                errors.append(f"{name}: {e}")
                continue
            _STATE = BlasState(path=_where(lib, name), note="loaded for MLX's CPU backend")
            break
        else:
            if os.environ.get(BLAS_ENV):
                _STATE.note = f"{BLAS_ENV} could not be loaded ({'; '.join(errors)})"
    return _STATE


def state() -> BlasState:
    """What `preload` did in this process."""
    return _STATE if _STATE is not None else BlasState(note="not checked")


def _where(lib: ctypes.CDLL, name: str) -> str:
    """The file a loaded library came from (its name when the loader does not say)."""
    try:
        with open("/proc/self/maps") as maps:
            stem = Path(name).name.split(".so")[0]
            for line in maps:
                path = line.split()[-1]
                if stem in Path(path).name:
                    return path
    except OSError:
        pass
    return name
