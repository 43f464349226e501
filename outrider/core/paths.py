"""Where outrider keeps its own files (calibrations, converted drafters)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$OUTRIDER_CACHE, else ~/.cache/outrider."""
    env = os.environ.get("OUTRIDER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outrider"
