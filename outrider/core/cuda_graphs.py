"""Whether MLX's CUDA backend records its kernels into CUDA graphs (`MLX_USE_CUDA_GRAPHS`).

MLX's CUDA backend (its `CommandEncoder`, mlx/backend/cuda/device.cpp) records every 20 kernels
(`MLX_MAX_OPS_PER_BUFFER`) into a CUDA graph, keyed by the graph's shape; it updates a cached
executable graph where the key was seen before and instantiates one where not, and it drops
every cached graph once it holds more than `MLX_CUDA_GRAPH_CACHE_SIZE` (100). A one-row plain
step sends the same shapes every step and gains from it. Batched speculative rounds send a
different mix every round (the widths, the rows joining and leaving), and the graphs cost more
than they save: on an H100 the demo pair's continuous batching ran at about 1.45x the tokens/s
with graphs off, and one-row plain decoding at 0.75x (docs/performance.md, "MLX's CUDA graphs
and batched rounds").

MLX reads the switch once, when the process runs its first GPU kernel (a function-local
static in its CUDA backend), so it is chosen before a model loads: `outrider serve` turns the
graphs off when it batches (`--cuda-graphs auto`, its default, at `--max-batch` above 1).
Off a CUDA GPU the variable is never read, and nothing changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from .errors import OutriderError

ENV = "MLX_USE_CUDA_GRAPHS"
SETTINGS = ("auto", "on", "off")


def choose(setting: str, max_batch: int, environ: Mapping[str, str] | None = None) -> str | None:
    """What `setting` (auto, on, off) asks of MLX's graphs for a server batching up to
    `max_batch` rows: "on", "off", or None to leave MLX as it is (its default, on, or what the
    user put in the environment, which `auto` never overrides)."""
    environ = os.environ if environ is None else environ
    setting = setting.strip().lower()
    if setting not in SETTINGS:
        raise OutriderError(f"--cuda-graphs must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting
    if ENV in environ or max_batch < 2:
        return None
    return "off"


def apply(setting: str, max_batch: int) -> str | None:
    """Set `MLX_USE_CUDA_GRAPHS` as `choose` decides, before MLX's first GPU kernel (after
    it, MLX keeps what it read). Returns the choice made (None: nothing was set)."""
    choice = choose(setting, max_batch)
    if choice is not None:
        os.environ[ENV] = "1" if choice == "on" else "0"
    return choice


def state(environ: Mapping[str, str] | None = None) -> str:
    """ "on" or "off": what MLX's CUDA backend does with graphs in this process, as it reads the
    environment (C's `atoi` of the value, nonzero for on; on when unset). So "false" and "off"
    turn them off, and so does "on": use 1 and 0."""
    environ = os.environ if environ is None else environ
    if ENV not in environ:
        return "on"
    return "on" if _atoi(environ[ENV]) else "off"


def _atoi(text: str) -> int:
    """C's `atoi`: leading whitespace, a sign, the digits that follow; 0 where there are none."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0
