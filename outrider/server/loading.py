"""What a server loads and how: the load's spec, the downloads done before the running model
is let go (`default_prefetch`), the loader (`default_loader`, `outrider.load`), and the watcher
that shows a load's downloads in `/health` and stops them when the load is cancelled. The
engine (`engine.py`) runs these on its worker thread."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ..core import hub
from ..pipeline import Pipeline


@dataclass
class LoadSpec:
    """What to load: a target, optionally a drafter, and per-load overrides."""

    model: str
    drafter: str | None = None
    mode: str = "auto"
    max_draft: int | str | None = None  # a cap, or "auto"
    context_window: int | None = None
    confidence_threshold: float | None = None
    drafter_bits: int = 4
    kv_bits: int | None = None
    draft_model: str | None = None  # mode draft's small model (mlx-lm's --draft-model)
    lookup_drafts: bool | None = None  # None: the registry row's `lookup`, else on
    drafter_window: int | None = None  # context rows a block drafter sees (0: all)
    lookup_long_draft: int | None = None  # the longest lookup copy a round verifies
    # a throwaway generation before the model serves (`Pipeline.warm_up`); None: on a GPU
    # (which builds kernels on first use), not on MLX's CPU backend (which builds none)
    warmup: bool | None = None


# The LoadSpec fields a server's flags set for every load, /admin/load's hot swaps included,
# unless a load names its own (`Engine.load_settings`): how to run a model, not which one.
SERVER_SETTINGS = (
    "max_draft", "confidence_threshold", "drafter_bits", "kv_bits", "lookup_drafts",
    "drafter_window", "lookup_long_draft", "warmup",
)  # fmt: skip


@dataclass
class LoadJob:
    spec: LoadSpec
    cancel: threading.Event = field(default_factory=threading.Event)
    window_before: int | None = None  # the context-window limit to restore if the load fails
    previous: LoadSpec | None = None  # what was serving when the worker took the load
    released: bool = False  # the previous model was let go (past the download)
    repos: set[str] = field(default_factory=set)  # repos its downloads fetched from
    cleanup: bool = False  # a cancel asked that the partial downloads be deleted


def default_prefetch(spec: LoadSpec) -> None:
    """Download what `default_loader` will read (the target, and the drafter it will use)
    before the running model is released, so a cancelled or failed download leaves it loaded
    and serving. An explicit drafter that cannot be had fails the load; a missing registry
    drafter is left to `load`, which falls back to lookup and says so."""
    from ..core.errors import ModelNotFoundError
    from ..registry import find_pair

    hub.resolve_model(spec.model, "model")
    drafter = spec.drafter
    if spec.mode in ("lookup", "baseline"):
        return
    if drafter is None:
        pair = find_pair(spec.model)
        drafter = (
            pair.drafters.get(pair.mode if spec.mode == "auto" else spec.mode) if pair else None
        )
    if drafter is None:
        return
    try:
        hub.resolve_model(drafter, "drafter")
    except ModelNotFoundError:
        if spec.drafter is not None:
            raise


class LoadWatcher(hub.DownloadWatcher):
    """A load's downloads, seen from `/health`; its cancel flag stops them."""

    def __init__(self, engine: Any, job: LoadJob) -> None:
        self._engine, self._job = engine, job
        self.context_window = engine.window_limit

    def begin(self, state: hub.DownloadState) -> None:
        self._job.repos.add(state.repo)
        self._engine.download = state.as_dict()

    def update(self, state: hub.DownloadState) -> None:
        self._engine.download = state.as_dict()

    def end(self, state: hub.DownloadState, ok: bool) -> None:
        self._engine.download = None

    def warn(self, message: str) -> None:
        self._engine.warning = " ".join(message.split())
        print(f"warning: {self._engine.warning}", file=sys.stderr, flush=True)

    def cancelled(self) -> bool:
        return self._job.cancel.is_set()


def wants_warm_up(spec: LoadSpec) -> bool:
    """Whether a load warms its pipeline up before serving: as asked, else on a GPU."""
    if spec.warmup is not None:
        return spec.warmup
    from ..core.device import computes_on_host

    return not computes_on_host()


def default_loader(spec: LoadSpec) -> Pipeline:
    from ..api import load

    return load(
        spec.model,
        spec.drafter,
        spec.mode,
        max_draft=spec.max_draft,
        confidence_threshold=spec.confidence_threshold,
        drafter_bits=spec.drafter_bits,
        kv_bits=spec.kv_bits,
        draft_model=spec.draft_model,
        lookup_drafts=spec.lookup_drafts,
        drafter_window=spec.drafter_window,
        lookup_long_draft=spec.lookup_long_draft,
    )
