"""Continuous batching on the engine's thread: up to `max_batch` requests decode together in
one batch (`Pipeline.make_batch`); each joins after its own prefill, at a round boundary,
and leaves the moment it finishes."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from ..pipeline import Pipeline
from .jobs import Job, Requests, Running


def decode_batch(
    pipe: Pipeline,
    first: Job,
    requests: Requests,
    arrivals: Callable[[int], list[Job]],
    max_batch: int,
    running: dict[int, Running],
) -> None:
    """Decode `first` and every request `arrivals(room)` hands over while it runs, until the
    batch drains. `running` holds the batch's requests by row while they decode (the engine
    cancels them when it stops). A round that raises fails every request in it."""
    batch = pipe.make_batch()
    waiting = [first]
    try:
        while waiting or len(batch):
            for job in waiting:
                _admit(pipe, batch, job, requests, running)
            waiting = arrivals(max_batch - len(batch))
            if not len(batch):
                continue
            requests.metrics.batch_round(len(batch))
            for row, step in batch.round():
                requests.metrics.drafts_cut(step.cut)
                run = running[id(row)]
                chunk = run.collector.add(step)
                run.add(chunk)
                if chunk.result is not None:
                    del running[id(row)]
                    requests.report(run, chunk.result)
                    requests.done(run.job)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        for run in list(running.values()) + [Running(j) for j in waiting]:
            requests.failed(run.job, e)
            requests.done(run.job)
        running.clear()


def _admit(
    pipe: Pipeline, batch: Any, job: Job, requests: Requests, running: dict[int, Running]
) -> None:
    """Prefill `job` alone and add its row to the batch (or finish it, if that was all)."""
    if job.cancel.is_set():
        requests.left_while_waiting(job)
        requests.done(job)
        return
    try:
        start = pipe.start_row(
            job.prompt,
            cancelled=job.cancel.is_set,
            prefill_progress=requests.rounds.prefill_of(job.number),
            **job.options,
        )
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        requests.failed(job, e)
        requests.done(job)
        return
    run = Running(job, collector=start.collector, log=requests.rounds, mode=pipe.mode)
    run.add(start.first)
    if start.row is None:
        requests.report(run, start.first.result)
        requests.done(job)
        return
    running[id(start.row)] = run
    batch.join(start.row, start.cache)
