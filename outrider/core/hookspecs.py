"""Hook specifications: what a plugin may provide to outrider.

Each hook receives a `register` callable; a plugin calls it once per thing it provides
(the style of simonw/llm). Built-in plugins live in `outrider.plugins`; third-party plugins are
found through the `outrider` entry-point group.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("outrider")
hookimpl = pluggy.HookimplMarker("outrider")


@hookspec
def register_target_families(register):
    """Register target families: register(family), family implementing core.family.TargetFamily."""


@hookspec
def register_drafter_formats(register):
    """Register drafter checkpoint formats: register(fmt), fmt implementing core.formats.DrafterFormat."""


@hookspec
def register_strategies(register):
    """Register drafting strategies: register(strategy), see core.strategy.Strategy."""


@hookspec
def register_commands(cli):
    """Add sub-commands to the `outrider` typer app."""


@hookspec
def register_matmul_kernels(register):
    """Register kernels for quantized products of a few rows (a verify's): register(kernel),
    kernel implementing core.row_kernels.RowsKernel."""
