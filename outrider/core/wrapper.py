"""The base of outrider's per-instance wrappers around a loaded model's own submodules.

outrider never patches a model class: where it needs to see or change what one layer does (taps,
recurrent-state records, split attention), it puts a wrapper in front of that layer on the one
loaded instance. Code that reads the model (mlx-lm's forward, a family's helpers) still finds
the wrapped module's attributes on the wrapper.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


class PassThrough(nn.Module):
    """A module standing in front of its child `wrapped` (a subclass names it); attributes the
    wrapper lacks are read from that child."""

    wrapped = ""
    # what the wrapper changes in how a forward computes ("" where it only observes, as taps
    # do): measurements of the model's speed are kept per route (core/calibration.py)
    route = ""

    def __getattr__(self, key: str) -> Any:
        # Reads the wrapper's own entries (its child, its arrays) straight from the dict that a
        # module is, and delegates without raising first: a wrapper's `self.linear` runs on
        # every call of every layer, paid on the host that launches a GPU's kernels. Through
        # `super()` and a caught AttributeError, an own read took 0.78 µs and a read through to
        # the child 2.4 µs; now 0.65 and 1.4 (2-core CPU, 2026-12-07).
        value = self.get(key)
        if value is not None:
            return value
        name = type(self).wrapped
        child = self.get(name)
        if key == name or child is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        return getattr(child, key)


def routes(model: nn.Module) -> str:
    """The routes of the wrappers in front of `model`'s layers, sorted and comma-joined, or
    "native" where none changes how the model computes."""
    found = {type(m).route for _, m in model.named_modules() if isinstance(m, PassThrough)}
    return ",".join(sorted(found - {""})) or "native"


def children(module: nn.Module) -> list[tuple[Any, Any, nn.Module]]:
    """(holder, key, child) for each submodule held by `module` directly or in a list of it
    (a model's layers), so that `holder[key] = ...` replaces it there (on the one instance)."""
    slots = []
    for key, value in module.items():
        entries = enumerate(value) if isinstance(value, list) else [(key, value)]
        holder = value if isinstance(value, list) else module
        slots += [(holder, k, v) for k, v in entries if isinstance(v, nn.Module)]
    return slots
