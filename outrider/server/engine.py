"""The engine: one worker thread owns the model and every piece of MLX work.

Requests queue to it; loads and unloads queue too, so a model is loaded on the thread that
generates with it. Streaming crosses to the HTTP side through an asyncio.Queue fed with
`loop.call_soon_threadsafe`, so the event loop never blocks on MLX. A job's cancel flag is
checked between prefill chunks and between rounds: a client that goes away stops its generation
within one chunk or round, even in the middle of a long prompt.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..api import Pipeline
from ..core.prefix_cache import PrefixCache
from .metrics import Metrics


@dataclass
class LoadSpec:
    """What to load: a target, optionally a drafter, and per-load overrides."""

    model: str
    drafter: str | None = None
    mode: str = "auto"
    max_draft: int | None = None
    context_window: int | None = None
    confidence_threshold: float | None = None
    drafter_bits: int = 4


@dataclass
class Job:
    """One generation: prompt ids, Pipeline.stream keywords, and the way back to its request."""

    prompt: list[int]
    options: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0  # generated so far (read by tests and metrics)


@dataclass
class _Load:
    spec: LoadSpec
    cancel: threading.Event = field(default_factory=threading.Event)
    window_before: int | None = None  # the context-window limit to restore if the load fails


class _Unload:
    pass


@dataclass
class _SetPrefixCache:
    store: PrefixCache | None


_STOP = object()


class NotReady(Exception):
    """No model is loaded (or one is loading)."""


def default_loader(spec: LoadSpec) -> Pipeline:
    from ..api import load

    return load(
        spec.model,
        spec.drafter,
        spec.mode,
        max_draft=spec.max_draft,
        confidence_threshold=spec.confidence_threshold,
        drafter_bits=spec.drafter_bits,
    )


class Engine:
    """Owns the pipeline; runs loads, unloads and generations one at a time on its thread."""

    def __init__(
        self,
        loader: Callable[[LoadSpec], Pipeline] = default_loader,
        metrics: Metrics | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`prefix_cache` keeps target caches between requests (the worker thread owns it;
        it is emptied whenever the model changes)."""
        self._loader = loader
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)
        self._lock = threading.Lock()
        self.metrics = metrics or Metrics()
        self.metrics.queue_depth = self._jobs.qsize
        self.pipeline: Pipeline | None = None
        self.spec: LoadSpec | None = None
        self.state = "no_model"  # no_model | loading | ready | error
        self.phase: str | None = None
        self.error: str | None = None
        self.load_started: float | None = None
        self._pending_load: _Load | None = None
        self._serving: LoadSpec | None = None  # what the current pipeline was loaded from
        self.window_limit: int | None = None  # sticky across loads; 0 in a LoadSpec clears it
        self._current: Job | None = None
        self.prefix_cache = prefix_cache
        self.metrics.prefix_cache = self._prefix_stats
        self._prefix_seen: dict[str, int] | None = None  # stats as of the last generation

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the running generation's next round (queued jobs are dropped)."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                item.cancel.set()
                self._post(item, "end", None)
        current = self._current
        if current is not None:
            current.cancel.set()
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    # -- requests from the HTTP side -----------------------------------------------------------
    def load(self, spec: LoadSpec) -> None:
        """Queue a load (the current model is released first, so peak memory is one model)."""
        job = _Load(spec, window_before=self.window_limit)
        with self._lock:
            if self._pending_load is not None:
                self._pending_load.cancel.set()
            self._pending_load = job
            self.state, self.phase, self.error = "loading", "queued", None
            self.load_started = time.time()
            self.spec = spec
            if spec.context_window is not None:
                self.window_limit = spec.context_window or None
        self._jobs.put(job)

    def cancel_load(self) -> bool:
        """Cancel a queued or running load; a running one is discarded when it returns."""
        with self._lock:
            job = self._pending_load
            if job is None or job.cancel.is_set():
                return False
            job.cancel.set()
            self._pending_load = None
            self.state = "ready" if self.pipeline is not None else "no_model"
            self.phase = None
            if self.pipeline is None:
                self.spec = None
            return True

    def unload(self) -> None:
        self._jobs.put(_Unload())

    def set_prefix_cache(self, store: PrefixCache | None) -> None:
        """Swap the prefix cache (None: off); takes effect before the next queued job."""
        self._jobs.put(_SetPrefixCache(store))

    def _prefix_stats(self) -> dict[str, int] | None:
        return self._prefix_seen

    def submit(self, job: Job) -> None:
        if self.pipeline is None or self.state != "ready":
            raise NotReady(self.state)
        with self._lock:
            self.metrics.in_flight += 1
        self._jobs.put(job)

    @property
    def context_window(self) -> int | None:
        pipe = self.pipeline
        limit = self.window_limit
        if pipe is None:
            return limit
        native = pipe.target.context_window
        if limit and native:
            return min(int(limit), int(native))
        return int(limit or native) if (limit or native) else None

    def status(self) -> dict[str, Any]:
        pipe = self.pipeline
        out: dict[str, Any] = {
            "state": self.state,
            "phase": self.phase,
            "error": self.error,
            "elapsed_s": round(time.time() - self.load_started, 3) if self.load_started else None,
            "requested": asdict(self.spec) if self.spec else None,
        }
        if pipe is not None:
            out.update(
                model=model_id(pipe),
                mode=pipe.mode,
                max_draft=pipe.max_draft,
                drafter=pipe.drafter_ref,
            )
        return out

    # -- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            try:
                self._handle(item)
            except Exception:  # the worker must outlive any one job
                traceback.print_exc(file=sys.stderr)
                self.metrics.error("engine")

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Load):
            self._do_load(item)
        elif isinstance(item, _SetPrefixCache):
            self.prefix_cache = item.store
            self._prefix_seen = None if item.store is None else item.store.snapshot_stats()
        elif isinstance(item, _Unload):
            self._release()
            with self._lock:
                if self._pending_load is None:
                    self.state, self.spec, self.phase = "no_model", None, None
        else:
            self._current = item
            try:
                self._generate(item)
            finally:
                self._current = None
                with self._lock:
                    self.metrics.in_flight -= 1

    def _release(self) -> None:
        self.pipeline = None
        if self.prefix_cache is not None:  # its caches belong to the model going away
            self.prefix_cache.clear()
            self._prefix_seen = self.prefix_cache.snapshot_stats()
        gc.collect()
        try:
            import mlx.core as mx

            mx.clear_cache()
        except Exception:  # pragma: no cover - older MLX
            pass

    def _do_load(self, job: _Load) -> None:
        """Release the running model (peak memory stays one model), load the new one; if that
        fails, load the previous one again, so a bad load never leaves the server empty."""
        if job.cancel.is_set():
            return
        previous = self._serving if self.pipeline is not None else None
        with self._lock:
            self.phase = "releasing"
        self._release()
        with self._lock:
            self.phase = "loading"
        try:
            pipe, spec, error = self._loader(job.spec), job.spec, None
        except Exception as e:
            pipe, spec, error = None, previous, f"could not load {job.spec.model}: {e}"
            if previous is not None:
                with self._lock:
                    self.phase = "restoring"
                try:
                    pipe = self._loader(previous)
                    error += f"; still serving {previous.model}"
                except Exception as again:
                    pipe, spec = None, None
                    error += f"; restoring {previous.model} failed too: {again}"
        with self._lock:
            if job.cancel.is_set() or self._pending_load is not job:  # cancelled meanwhile
                keep = False
            else:
                keep = pipe is not None
                self._pending_load = None
                self.phase, self.error = None, error
                if keep:
                    self.pipeline, self.state, self.spec, self._serving = pipe, "ready", spec, spec
                else:
                    self.state, self.spec, self._serving = "error", None, None
                if error is not None:
                    self.window_limit = job.window_before
        if not keep:
            pipe = None
            self._release()

    @staticmethod
    def _post(job: Job, kind: str, value: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's event loop is gone
            job.cancel.set()

    def _generate(self, job: Job) -> None:
        def post(kind: str, value: Any) -> None:
            self._post(job, kind, value)

        pipe = self.pipeline
        if job.cancel.is_set() or pipe is None:
            post("end", None)
            return
        pipe.prefix_cache = self.prefix_cache
        stream = pipe.stream(job.prompt, cancelled=job.cancel.is_set, **job.options)
        result = None
        accepts: list[int] = []
        try:
            for chunk in stream:
                job.tokens += len(chunk.tokens)
                if chunk.step.source == "draft":
                    accepts.append(chunk.step.accepted + 1)
                result = chunk.result
                post("chunk", chunk)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.metrics.error("generation")
            post("error", e)
            return
        finally:
            stream.close()  # keeps the final cache (the prefix cache) before "end" is posted
            if self.prefix_cache is not None:
                self._prefix_seen = self.prefix_cache.snapshot_stats()
        if result is not None and result.finish_reason == "cancelled":
            with self._lock:
                self.metrics.cancelled += 1
            result = None  # the request is gone (or the server stopping): nothing to answer
        tps = result.decode_tps if result is not None else 0.0
        self.metrics.generation(len(job.prompt), job.tokens, accepts, tps)
        post("end", result)


def model_id(pipe: Pipeline) -> str:
    """The name clients use: the target's folder or repo name."""
    return Path(pipe.target.name.rstrip("/")).name or "model"
