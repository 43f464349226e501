"""The Python API: `load` a target (and drafter) into a Pipeline, then generate or stream.

The Pipeline itself lives in `outrider/pipeline.py`; it is importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core import calibration, kernels
from .core.calibration import Calibration
from .core.errors import OutriderError
from .core.events import Result
from .core.plugins import Plugins
from .core.prefix_cache import PrefixCache
from .core.proposer import Proposer
from .core.target import Target
from .loaders import (
    auto_drafter,
    check_options,
    check_pair,
    draft_mode,
    load_drafter,
    load_target,
    resolve_mode,
)
from .pipeline import Pipeline
from .plugins.strategies.lookup_assist import LookupAssist
from .prompts import Prompt
from .registry import Pair

__all__ = [
    "Pipeline",
    "calibrate_first_use",
    "load",
    "load_pair",
    "pipeline_from_parts",
    "speculative_generate",
]


def load(
    model: str,
    drafter: str | None = None,
    mode: str = "auto",
    *,
    max_draft: int | str | None = None,
    confidence_threshold: float | None = None,
    drafter_bits: int = 4,
    download: bool = True,
    plugins: Plugins | None = None,
    target: Target | None = None,
    prefix_cache: PrefixCache | None = None,
    kv_bits: int | None = None,
    registry: list[Pair] | None = None,
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
    lookup_drafts: bool | None = None,
    drafter_window: int | None = None,
    lookup_long_draft: int | None = None,
) -> Pipeline:
    """Load a target (local folder or Hugging Face repo id) and its drafting strategy.

    `target` reuses an already-loaded target for `model` (a benchmark builds every mode on one).
    `prefix_cache` keeps target caches between calls (see `Pipeline.enable_prefix_cache`).
    `kv_bits` (8 or 4) quantizes the target's KV cache (see `Target.quantize_kv`); a `target`
    given keeps its own setting when `kv_bits` is None (it is shared: other pipelines use it).
    `max_draft="auto"` lets each round pick its cap from measured costs and acceptance, and
    decode plainly while speculation does not pay (`core/schedule.py`); `max_draft="full"` is
    the drafter's whole block every round (what mlx-dspark's `--max-draft 0` meant).

    The target loads first, so a missing target is reported as such. With mode "auto" and no
    drafter given, the registry row's mode runs, else any other drafter mode the row names that
    loads, else drafter-free lookup; a fallback says which and why in one `Pipeline.notes` line.
    `registry` replaces the shipped registry rows. `draft_model` (mlx-lm's --draft-model: a
    small causal LM with the target's tokenizer) runs mode draft; `num_draft_tokens` is
    mlx-lm's name for its cap. `lookup_drafts` (default: the registry row's `lookup`, else on)
    lets a drafter's round verify a lookup copy of the context instead where the text is being
    copied (`plugins/strategies/lookup_assist.py`). `drafter_window` (DSpark and DFlash block
    drafters) is how many of the latest context rows the drafter sees: 0 all of them, default
    the registry row's, else 4096 (`plugins/strategies/block_proposer.py`).
    `lookup_long_draft` is the longest lookup copy one round verifies (default 32 where a
    drafter's rounds take copies, 16 in mode lookup); a copy drafts twice the length of its
    match, up to this, where the calibrated verify curve allows it.

    A calibration of this machine kept for the pipeline makes `auto` its default cap policy;
    with none kept and no cap given the registry's fixed cap runs, until `outrider calibrate`
    or `calibrate_first_use` measures one.
    """
    max_draft = check_options(
        max_draft, num_draft_tokens, drafter_bits, lookup_long_draft, confidence_threshold,
        drafter_window, kv_bits,
    )  # fmt: skip
    requested_cap = max_draft
    auto_cap, full_block = max_draft == "auto", max_draft == "full"
    if auto_cap or full_block:
        max_draft = None
    plugins = plugins or Plugins()
    mode = draft_mode(mode, drafter, draft_model)
    requested, explicit = mode, drafter
    mode, drafter, pair = resolve_mode(plugins, model, mode, drafter, registry)
    if drafter is not None and mode in ("lookup", "baseline") and requested != "auto":
        raise OutriderError(f"--mode {mode} uses no drafter; drop --drafter or pick a drafter mode")
    notes: list[str] = []
    if target is None:
        target = load_target(plugins, model, download)
        notes += target.notes
    if kv_bits is not None and kv_bits != target.kv_bits:
        target.quantize_kv(kv_bits)  # a shared target keeps its setting unless asked
    spec = None
    if requested == "auto" and explicit is None and pair is not None:
        mode, drafter, spec = auto_drafter(plugins, pair, download, notes)
    elif drafter is not None and mode not in ("lookup", "baseline"):
        spec = load_drafter(plugins, drafter, download)  # given, or the row's for this mode
        if mode == "auto-drafter":
            mode = spec.kind
    strategy = plugins.strategy(mode)
    if spec is not None and strategy.needs_drafter:
        check_pair(target, spec)
    requested_threshold = confidence_threshold
    if confidence_threshold is None:
        confidence_threshold = pair.confidence_threshold if pair else 0.0
    options = {"drafter_bits": drafter_bits, "confidence_threshold": confidence_threshold}
    requested_window = drafter_window
    if drafter_window is None and pair is not None:
        drafter_window = pair.drafter_window
    if drafter_window is not None:
        options["drafter_window"] = drafter_window
    if mode == "draft" and draft_model is not None:
        # the draft model loads like a target: its family rolls its cache back
        options.update(draft_model=load_target(plugins, draft_model, download))
        options.update(draft_model_name=draft_model)
    if lookup_long_draft is not None:
        options["lookup_max_draft"] = lookup_long_draft  # mode lookup's longest copy
    proposer = strategy.build(target, spec if strategy.needs_drafter else None, options)
    if proposer.tap_layer_ids:
        target.install_taps(tuple(proposer.tap_layer_ids))  # the one-time load probe
    if lookup_drafts is None:
        lookup_drafts = pair.lookup if pair else True
    if lookup_drafts and getattr(proposer, "lookup_assist_safe", False):
        longest = {} if lookup_long_draft is None else {"max_lookup": lookup_long_draft}
        proposer = LookupAssist(proposer, **longest)
    if full_block:
        max_draft = proposer.max_draft
    elif max_draft is None:
        max_draft = pair.cap if pair and pair.mode == mode and pair.cap else strategy.default_cap
    elif max_draft > proposer.max_draft:
        notes.append(
            f"--max-draft {max_draft} is more than {mode} can draft a round; "
            f"running at cap {proposer.max_draft}"
        )
    cap = min(max_draft, proposer.max_draft)
    if requested_threshold is not None and mode != "dspark":
        notes.append(f"--confidence-threshold does nothing in {mode} mode (DSpark only)")
    if requested_window is not None and mode not in ("dspark", "dflash"):
        notes.append(f"--drafter-window does nothing in {mode} mode (DSpark and DFlash only)")
    ref = drafter if spec is not None and strategy.needs_drafter else None
    pipe = Pipeline(target, proposer, mode, cap, spec, pair, options, notes, ref, prefix_cache)
    pipe.auto_cap = auto_cap and proposer.max_draft > 0
    pipe.cap_given = isinstance(requested_cap, int) or full_block
    _, seconds = kernels.warm_at_load(target, proposer)
    if seconds >= 1.0:  # a cold machine: MLX compiled kernels (it keeps them on disk)
        pipe.info.append(
            f"prepared the quantized GPU kernels in {seconds:.0f} s (once per machine)"
        )
    if proposer.max_draft > 0 and (pipe.auto_cap or requested_cap is None):
        _calibrate(pipe, measure=pipe.auto_cap)
    return pipe


def _calibrate(pipe: Pipeline, measure: bool) -> None:
    """Attach this machine's calibration, which makes `auto` the cap policy: the stored one,
    else with `measure` one measured now and stored (`core/calibration.py`)."""
    if measure:
        cal, fresh = calibration.calibrated(pipe)
        if fresh:
            pipe.info.append(cal.measured_note())
    else:
        cal = calibration.load(pipe)
        if cal is None:
            return
    _attach(pipe, cal)


def _attach(pipe: Pipeline, cal: Calibration) -> None:
    pipe.auto_cap = True
    pipe.calibration = cal
    cal.pad(pipe.target)  # measured beats the default
    if isinstance(pipe.proposer, LookupAssist):
        pipe.proposer.calibration = cal  # bounds how wide a copy's verify may be


def calibrate_first_use(
    pipe: Pipeline, status: Callable[[str], None] | None = None
) -> Calibration | None:
    """Measure this machine's costs for `pipe` now, where none are kept and no cap was given,
    and run `auto` from here: the default from the first run, not after `outrider calibrate`
    (a registry's fixed cap can run slower than plain decoding where drafting does not pay).
    Returns the calibration measured, None where there was nothing to measure. `status` hears
    that it starts (a terminal's spinner, a server's log). generate, serve and benchmark call it;
    a library caller's default stays the fixed cap until asked."""
    if pipe.calibration is not None or pipe.cap_given or pipe.proposer.max_draft <= 0:
        return None
    if not calibration.on_first_use():  # OUTRIDER_CALIBRATE=off
        return None
    if status is not None:
        name = pipe.target.name or "the target"
        name = Path(name).name if Path(name).exists() else name  # a file or folder: its name
        status(f"calibrating this machine for {name} (once; --max-draft N skips it)")
    cal, _ = calibration.calibrated(pipe)
    _attach(pipe, cal)
    return cal


def load_pair(
    model: str, drafter: str | None = None, *, mode: str = "auto", **options: Any
) -> Pipeline:
    """The reference project's name for loading a target with its drafter."""
    return load(model, drafter, mode, **options)


def speculative_generate(pipeline: Pipeline, prompt: Prompt, **sampling: Any) -> Result:
    """Generate with speculative decoding (the reference project's name)."""
    return pipeline.generate(prompt, **sampling)


def pipeline_from_parts(
    target: Target, proposer: Proposer, mode: str = "custom", max_draft: int | None = None
) -> Pipeline:
    """A pipeline over an already-built target and proposer (tests, benchmarks, plugins)."""
    cap = proposer.max_draft if max_draft is None else min(max_draft, proposer.max_draft)
    return Pipeline(target, proposer, mode, cap)
