"""A generation request as the engine's thread sees it, and how its events and accounting
reach the HTTP side: chunks and the end cross through the request's asyncio queue, fed with
`loop.call_soon_threadsafe`; counts go to the server's metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import OutriderError
from .metrics import Metrics
from .rounds import RoundLog

SLOW_ENV = "OUTRIDER_SLOW_ROUND_S"
slow_log = logging.getLogger("outrider.slow")


def slow_round_seconds() -> float:
    """How long a round or plain step may take before the server logs it (`$OUTRIDER_SLOW_ROUND_S`,
    default 10 s, 0: never). A round that long means something is wrong (memory pressure and
    swapping, a machine shared with heavy work), and a client only sees a stalled stream."""
    text = os.environ.get(SLOW_ENV, "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise OutriderError(f"{SLOW_ENV} must be a number of seconds >= 0, got {text!r}")
    return seconds


@dataclass
class Job:
    """One generation: prompt ids, Pipeline.stream keywords, and the way back to its request."""

    prompt: list[int]
    options: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0  # generated so far (read by tests and metrics)
    number: int = 0  # the engine's count of requests it was given (the round log's `req`)
    # another mode's pipeline over the loaded target (a race arm), run alone instead of the
    # loaded pipeline; None: the loaded one
    pipeline: Any = None


def post(job: Job, kind: str, value: Any) -> None:
    """Hand an event ("chunk", "error", "end") to the request's event loop; a loop that is
    gone cancels the job."""
    try:
        job.loop.call_soon_threadsafe(job.events.put_nowait, (kind, value))
    except RuntimeError:  # the request's event loop is gone
        job.cancel.set()


@dataclass
class Running:
    """A running request: its job, its chunk collector (in a batch), its acceptance so far."""

    job: Job
    collector: Any = None
    accepts: list[int] = field(default_factory=list)
    log: RoundLog | None = None  # the engine's recent rounds (GET /rounds, /events)
    mode: str = ""
    steps: int = 0
    slow_s: float = field(default_factory=slow_round_seconds)  # 0: never logged

    def add(self, chunk: Any) -> None:
        self.job.tokens += len(chunk.tokens)
        step = chunk.step
        if self.slow_s and step.source != "prefill" and step.seconds > self.slow_s:
            slow_log.warning(
                "request %d: a %s step took %.1f s (drafted %d, committed %d); see %s",
                self.job.number, "speculative" if step.source == "draft" else "plain",
                step.seconds, len(step.drafted), len(step.committed), SLOW_ENV,
            )  # fmt: skip
        if chunk.step.source == "draft":
            self.accepts.append(chunk.step.accepted + 1)
        if self.log is not None:
            self.log.add(self.job.number, self.mode, self.steps, chunk.step)
        self.steps += 1
        post(self.job, "chunk", chunk)


class Requests:
    """The accounting of requests the engine runs, one at a time or batched: in flight,
    cancelled, each finished generation's figures, and the events that end them."""

    def __init__(self, metrics: Metrics, lock: threading.Lock, rounds: RoundLog) -> None:
        self.metrics, self._lock, self.rounds = metrics, lock, rounds

    def report(self, run: Running, result: Any) -> None:
        """Metrics for a finished generation, then its "end" event (no answer if cancelled:
        the request is gone, or the server is stopping)."""
        job = run.job
        if result is not None and result.finish_reason == "cancelled":
            with self._lock:
                self.metrics.cancelled += 1
            result = None
        tps = result.decode_tps if result is not None else 0.0
        self.metrics.generation(len(job.prompt), job.tokens, run.accepts, tps)
        post(job, "end", result)

    def failed(self, job: Job, error: Exception) -> None:
        """A generation that raised: counted, and the error handed to its request."""
        self.metrics.error("generation")
        post(job, "error", error)

    def left_while_waiting(self, job: Job) -> None:
        """A request whose client went away before it started: counted as cancelled, ended."""
        with self._lock:
            self.metrics.cancelled += 1
        post(job, "end", None)

    def done(self, job: Job) -> None:
        """The request no longer counts as in flight."""
        with self._lock:
            self.metrics.in_flight -= 1
