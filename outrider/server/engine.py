"""The engine: one worker thread owns the model and every piece of MLX work.

Requests queue to it; loads and unloads queue too, so a model is loaded on the thread that
generates with it. Streaming crosses to the HTTP side through an asyncio.Queue fed with
`loop.call_soon_threadsafe`, so the event loop never blocks on MLX. A job's cancel flag is
checked between prefill chunks and between rounds: a client that goes away stops its generation
within one chunk or round, even in the middle of a long prompt.
"""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..core import hub
from ..core.device import release_streams
from ..core.prefix_cache import PrefixCache
from ..pipeline import Pipeline
from .batching import decode_batch
from .jobs import Job, Requests, Running, post
from .loading import (
    SERVER_SETTINGS,
    LoadJob,
    LoadSpec,
    LoadWatcher,
    default_loader,
    default_prefetch,
    wants_warm_up,
)
from .memory import HeapTrim, fit_warning, relieve_memory
from .metrics import Metrics
from .rounds import RoundLog


class _Unload:
    pass


@dataclass
class _SetPrefixCache:
    store: PrefixCache | None


_STOP = object()


class NotReady(Exception):
    """No model is loaded (or one is loading)."""


class Engine:
    """Owns the pipeline; runs loads, unloads and generations one at a time on its thread."""

    def __init__(
        self,
        loader: Callable[[LoadSpec], Pipeline] = default_loader,
        metrics: Metrics | None = None,
        prefix_cache: PrefixCache | None = None,
        prefetch: Callable[[LoadSpec], None] | None = None,
        max_batch: int = 1,
        batch_scheduler: bool = True,
        load_settings: dict[str, Any] | None = None,
        memory_guard: bool = True,
    ) -> None:
        """`prefix_cache` keeps target caches between requests (the worker thread owns it;
        it is emptied whenever the model changes). `prefetch` downloads what a load needs
        before the running model is released (default: `default_prefetch` with the default
        loader, nothing with another). `max_batch` > 1 decodes up to that many requests
        together (continuous batching) on targets whose family batches; others serve one at
        a time. `batch_scheduler` lets DSpark's prefix scheduler cut a batch's drafts where the
        model has a calibration (`core/schedule.py`); off, every row verifies its cap.
        `load_settings` (`SERVER_SETTINGS` keys: `serve`'s flags) fill what a hot swap's
        `/admin/load` leaves unset (`with_settings`). `memory_guard`: before a generation,
        past MEMORY_PRESSURE of the memory in use, give MLX's buffer cache back and then the
        prefix cache's memory tier (server/memory.py); off, nothing is shed."""
        unknown = set(load_settings or {}) - set(SERVER_SETTINGS)
        if unknown:
            raise ValueError(f"not server load settings: {sorted(unknown)}")
        self.load_settings = dict(load_settings or {})
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.batch_scheduler = batch_scheduler
        self.memory_guard = memory_guard
        self.heap_trim = HeapTrim()  # freed C heap back to the OS now and then (memory.py)
        self._deferred: list = []  # items taken from the queue while a batch ran
        self._running: dict[int, Running] = {}  # the batch's requests, by row
        self._loader = loader
        if prefetch is None and loader is default_loader:
            prefetch = default_prefetch
        self._prefetch = prefetch
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)
        self._lock = threading.Lock()
        self.metrics = metrics or Metrics()
        self.rounds = RoundLog()  # the last rounds run, across requests (GET /rounds, /events)
        self.requests = Requests(self.metrics, self._lock, self.rounds)
        self._submitted = 0
        self.metrics.queue_depth = self._jobs.qsize
        self.pipeline: Pipeline | None = None
        self.spec: LoadSpec | None = None
        self.state = "no_model"  # no_model | loading | ready | error
        self.phase: str | None = None
        self.error: str | None = None
        self.load_started: float | None = None
        self.download: dict[str, Any] | None = None  # the running download (DownloadState)
        self.warning: str | None = None  # the fit check's warning for the running load
        self.warm_up_error: str | None = None  # why the running load's warm-up failed
        self._pending_load: LoadJob | None = None
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
                post(item, "end", None)
        current = self._current
        if current is not None:
            current.cancel.set()
        for run in list(self._running.values()):  # a batch's requests
            run.job.cancel.set()
        pending = self._pending_load
        if pending is not None:  # a download in progress stops at its next chunk
            pending.cancel.set()
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    # -- requests from the HTTP side -----------------------------------------------------------
    def with_settings(self, spec: LoadSpec, named: set[str]) -> LoadSpec:
        """`spec` with the server's load settings where it names none (`named`: the fields a
        load request set), so a hot swap runs as `serve` was started."""
        kept = {k: v for k, v in self.load_settings.items() if k not in named and v is not None}
        return replace(spec, **kept)

    def load(self, spec: LoadSpec) -> None:
        """Queue a load (the current model is released first, so peak memory is one model)."""
        job = LoadJob(spec, window_before=self.window_limit)
        with self._lock:
            if self._pending_load is not None:
                self._pending_load.cancel.set()
            self._pending_load = job
            self.state, self.phase, self.error = "loading", "queued", None
            self.warning = self.warm_up_error = None
            self.load_started = time.time()
            self.spec = spec
            if spec.context_window is not None:
                self.window_limit = spec.context_window or None
        self._jobs.put(job)

    def cancel_load(self, cleanup: bool = False) -> bool:
        """Cancel a queued or running load. A download stops at its next chunk and the running
        model, never released, keeps serving; past the download the load is discarded when it
        returns and the previous model loaded again (`/health` says `loading` meanwhile).
        A stopped download's partial files stay for the next try to resume, unless `cleanup`:
        then they are deleted once it has stopped."""
        with self._lock:
            job = self._pending_load
            if job is None or job.cancel.is_set():
                return False
            job.cleanup = cleanup
            job.cancel.set()
            self.window_limit = job.window_before
            self.error = f"loading {job.spec.model} was cancelled"
            if job.released and job.previous is not None:  # the worker loads it again
                self.phase = "cancelling"
                return True
            self._pending_load = None
            self.state = "ready" if self.pipeline is not None else "no_model"
            self.phase, self.download = None, None
            self.spec = self._serving if self.pipeline is not None else None
            if self.pipeline is not None:
                self.error += f"; still serving {self._serving_name()}"
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
            self._submitted += 1
            job.number = self._submitted
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
            "warning": self.warning,
        }
        download = self.download
        if download is not None and self.state == "loading":
            out["download"] = download
        if pipe is not None:
            out.update(
                model=model_id(pipe),
                mode=pipe.mode,
                max_draft="auto" if pipe.auto_cap else pipe.max_draft,
                drafter=pipe.drafter_ref,
            )
        return out

    # -- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                item = self._deferred.pop(0) if self._deferred else self._jobs.get()
                if item is _STOP:
                    return
                try:
                    self._handle(item)
                except Exception:  # the worker must outlive any one job
                    traceback.print_exc(file=sys.stderr)
                    self.metrics.error("engine")
        finally:
            release_streams()  # the streams this thread made (core/device.py)

    def _handle(self, item: Any) -> None:
        if isinstance(item, LoadJob):
            self._do_load(item)
        elif isinstance(item, _SetPrefixCache):
            self.prefix_cache = item.store
            self._prefix_seen = None if item.store is None else item.store.snapshot_stats()
        elif isinstance(item, _Unload):
            self._release()
            with self._lock:
                if self._pending_load is None:
                    self.state, self.spec, self.phase = "no_model", None, None
        else:  # a generation
            self.heap_trim.maybe()
            if self.memory_guard:
                relieve_memory(self.prefix_cache, self.metrics)
            if self.batching and item.pipeline is None:
                self._generate_batched(item)
                return
            self._current = item
            try:
                self._generate(item)
            finally:
                self._current = None
                with self._lock:
                    self.metrics.in_flight -= 1

    @property
    def batching(self) -> bool:
        """Whether requests decode together: `max_batch` above 1 and a target that batches."""
        pipe = self.pipeline
        return self.max_batch > 1 and pipe is not None and pipe.target.batches

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

    def _do_load(self, job: LoadJob) -> None:
        """Download first, while the running model stays loaded (a cancelled or failed
        download leaves it serving); then release it (peak memory stays one model) and load
        the new one; if that fails or is cancelled, load the previous one again, so a bad load
        never leaves the server empty."""
        with self._lock:
            if job.cancel.is_set():
                return
            previous = job.previous = self._serving if self.pipeline is not None else None
            self.phase = "downloading" if self._prefetch is not None else self.phase
        if self._prefetch is not None:
            try:
                with hub.watch_downloads(LoadWatcher(self, job)):
                    self._prefetch(job.spec)
            except Exception as e:
                if not job.cancel.is_set():  # else cancel_load has said so already
                    self._keep_serving(job, f"could not load {job.spec.model}: {e}")
                elif job.cleanup:
                    for repo in sorted(job.repos):
                        hub.drop_partial_downloads(repo)
                return
            finally:
                self.download = None
        with self._lock:
            if job.cancel.is_set():
                return
            job.released = True
            self.phase = "releasing"
        self._release()
        with self._lock:
            self.phase = "loading"
        try:
            pipe, spec, error = self._loader(job.spec), job.spec, None
            for text in getattr(pipe, "info", ()):  # what the load did, said once
                print(f"note: {text}", file=sys.stderr, flush=True)
            if not job.cancel.is_set():
                self._calibrate(pipe)
            if wants_warm_up(job.spec) and not job.cancel.is_set():
                with self._lock:
                    self.phase = "warming_up"
                self._warm_up(pipe)
        except Exception as e:
            pipe, spec, error = None, previous, f"could not load {job.spec.model}: {e}"
        if pipe is not None and job.cancel.is_set():  # cancelled while it loaded
            pipe, spec, error = None, previous, f"loading {job.spec.model} was cancelled"
            self._release()
        if pipe is None and previous is not None and self._pending_load is job:
            with self._lock:
                self.phase = "restoring"
            try:
                pipe = self._loader(previous)
                error = f"{error}; still serving {previous.model}"
            except Exception as again:
                pipe, spec = None, None
                error = f"{error}; restoring {previous.model} failed too: {again}"
        with self._lock:
            if self._pending_load is not job:  # cancelled (nothing to restore) or superseded
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
        elif self.warning is None:
            self._check_fit(spec)

    def _calibrate(self, pipe: Pipeline) -> None:
        """A pair's first load here without a cap: its costs measured once, in phase
        `calibrating`, so `auto` serves from the start (`api.calibrate_first_use`)."""
        from ..api import calibrate_first_use

        def measuring(text: str) -> None:  # called only where it measures
            with self._lock:
                self.phase = "calibrating"
            print(f"note: {text}", file=sys.stderr, flush=True)

        if (cal := calibrate_first_use(pipe, status=measuring)) is not None:
            print(f"note: {cal.measured_note()}", file=sys.stderr, flush=True)

    def _warm_up(self, pipe: Pipeline) -> None:
        """The throwaway generation, best effort: one that fails costs a warning line (and
        one in /health), not the load (a request then says what is wrong, as it would have
        without it)."""
        try:
            pipe.warm_up()
        except Exception as e:
            self.warm_up_error = f"warming {pipe.target.name} up failed ({e}); serving anyway"
            print(f"warning: {self.warm_up_error}", file=sys.stderr, flush=True)

    def _check_fit(self, spec: LoadSpec) -> None:
        """Warn (stderr and /health) when the loaded model's KV cache, filled to the context
        window in every batched request, would not fit this machine (server/memory.py)."""
        message = fit_warning(spec, self.context_window, self.max_batch if self.batching else 1)
        if message:
            self.warning = message
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def _serving_name(self) -> str:
        return self._serving.model if self._serving is not None else "the previous model"

    def _keep_serving(self, job: LoadJob, error: str) -> None:
        """A load that failed before anything was released: the running model stays."""
        with self._lock:
            if self._pending_load is not job:
                return
            self._pending_load = None
            self.phase = None
            self.window_limit = job.window_before
            if self.pipeline is not None:
                self.state, self.spec = "ready", self._serving
                self.error = f"{error}; still serving {self._serving_name()}"
            else:
                self.state, self.spec, self.error = "error", None, error

    def _generate(self, job: Job) -> None:
        pipe = self.pipeline
        if job.cancel.is_set():
            self.requests.left_while_waiting(job)
            return
        if pipe is not None and job.pipeline is not None:  # a race arm of another mode
            if job.pipeline.target is not pipe.target:
                post(job, "error", RuntimeError("the model changed; run it again"))
                return
            pipe = job.pipeline
        if pipe is None:
            post(job, "end", None)
            return
        pipe.prefix_cache = self.prefix_cache
        stream = pipe.stream(
            job.prompt,
            cancelled=job.cancel.is_set,
            prefill_progress=self.rounds.prefill_of(job.number),
            **job.options,
        )
        run, result = Running(job, log=self.rounds, mode=pipe.mode), None
        try:
            for chunk in stream:
                run.add(chunk)
                result = chunk.result
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.requests.failed(job, e)
            return
        finally:
            stream.close()  # keeps the final cache (the prefix cache) before "end" is posted
            if self.prefix_cache is not None:
                self._prefix_seen = self.prefix_cache.snapshot_stats()
        self.requests.report(run, result)

    # -- continuous batching (server/batching.py) ----------------------------------------------
    def _generate_batched(self, first: Job) -> None:
        """Decode `first` and every request that arrives while it runs, up to `max_batch` at
        once. A load or unload that arrives waits until the batch drains."""
        pipe = self.pipeline
        pipe.prefix_cache = self.prefix_cache
        pipe.schedule_batches = self.batch_scheduler
        self._running = {}
        try:
            decode_batch(pipe, first, self.requests, self._arrivals, self.max_batch, self._running)
        finally:
            if self.prefix_cache is not None:
                self._prefix_seen = self.prefix_cache.snapshot_stats()

    def _arrivals(self, room: int) -> list[Job]:
        """Jobs queued since the last round (up to `room`); anything else waits its turn.
        Asked once a round, so it is also where a batch that never drains trims the heap."""
        self.heap_trim.maybe()
        out: list[Job] = []
        while len(out) < room and not self._deferred:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                out.append(item)
            else:
                self._deferred.append(item)
        return out


def model_id(pipe: Pipeline) -> str:
    """The name clients use: the target's folder or repo name."""
    return Path(pipe.target.name.rstrip("/")).name or "model"
