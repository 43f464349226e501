"""The embedded demo pair: a small code model and its DSpark and DFlash drafters.

It ships as package data under outrider/demo/pair/ (target/, dspark/, dflash/), built by
scripts/make_demo_pair.py. Its names are `outrider-demo/target`, `outrider-demo/dspark` and
`outrider-demo/dflash`: the registry row and `outrider generate` with no --model use them, and
model resolution maps them here instead of to the Hugging Face hub. $OUTRIDER_DEMO_DIR points
them at another pair (a freshly built one, or a test's).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import ModelNotFoundError

PREFIX = "outrider-demo/"
TARGET = PREFIX + "target"
PARTS = ("target", "dspark", "dflash")


def pair_dir() -> Path:
    """Where the demo pair lives: $OUTRIDER_DEMO_DIR, else the package's own copy."""
    env = os.environ.get("OUTRIDER_DEMO_DIR")
    return Path(env).expanduser() if env else Path(__file__).resolve().parent / "pair"


def is_demo(spec: str) -> bool:
    return spec.startswith(PREFIX) and spec[len(PREFIX) :] in PARTS


def demo_folder(spec: str) -> Path:
    """The folder for one of the demo names; a clear error when the pair is not installed."""
    part = spec[len(PREFIX) :]
    if part not in PARTS:
        raise ModelNotFoundError(f"{spec!r} is not part of the demo pair ({', '.join(PARTS)})")
    folder = pair_dir() / part
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"the demo pair's {part} is missing ({folder} has no config.json): build it with "
            "`python scripts/make_demo_pair.py --preset demo`, or pass --model"
        )
    return folder


def demo_target() -> str:
    """The demo target's path, for `generate` with no --model (its registry row picks dspark)."""
    demo_folder(TARGET)  # the missing-pair error, before anything loads
    return TARGET
