"""The batching driver's bookkeeping (server/batching.py), with a scripted pipeline: what
each request hears when a prefill or a round fails, and that every request leaves the
in-flight count exactly once. The real batch's outputs are tested in test_batch.py and
through the SDKs in test_server_batching.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from outrider.server.batching import decode_batch
from outrider.server.jobs import Job, Requests
from outrider.server.metrics import Metrics
from outrider.server.rounds import RoundLog


def chunk(result=None):
    step = SimpleNamespace(
        source="plain", drafted=[], accepted=0, committed=[7], seconds=1e-3, cut=0
    )
    return SimpleNamespace(tokens=[7], step=step, result=result)


class ScriptedBatch:
    """Rows that each finish after `length` rounds; round `fail_at` raises."""

    def __init__(self, length: int, fail_at: int | None) -> None:
        self.rows, self.rounds, self.length, self.fail_at = [], 0, length, fail_at

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row, cache) -> None:
        self.rows.append(row)

    def round(self):
        self.rounds += 1
        if self.rounds == self.fail_at:
            raise RuntimeError("the device went away")
        for row in list(self.rows):
            row.left -= 1
            if row.left == 0:
                self.rows.remove(row)
            yield row, SimpleNamespace(cut=0, left=row.left)


class ScriptedPipe:
    """A pipeline whose prefill of a prompt starting with 0 raises."""

    mode = "scripted"

    def __init__(self, length: int = 3, fail_at: int | None = None) -> None:
        self.batch = ScriptedBatch(length, fail_at)

    def make_batch(self) -> ScriptedBatch:
        return self.batch

    def start_row(self, prompt, cancelled, **options):
        if prompt[0] == 0:
            raise ValueError("prompt too long")
        row = SimpleNamespace(left=self.batch.length)
        collector = SimpleNamespace(
            add=lambda step: (
                chunk(SimpleNamespace(finish_reason="length", decode_tps=1.0))
                if step.left == 0
                else chunk()
            )
        )
        return SimpleNamespace(collector=collector, first=chunk(), row=row, cache=None)


def events(loop, job: Job) -> list[str]:
    loop.run_until_complete(asyncio.sleep(0))  # deliver what call_soon_threadsafe queued
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait()[0])
    return out


@pytest.mark.parametrize("fail_at", [None, 2])
def test_every_request_ends_once_whatever_fails(fail_at):
    loop = asyncio.new_event_loop()
    try:
        metrics = Metrics()
        rounds = RoundLog()
        requests = Requests(metrics, threading.Lock(), rounds)
        jobs = [Job([1, 2], {}, loop), Job([0, 2], {}, loop), Job([3], {}, loop)]
        jobs[2].cancel.set()  # its client left before it started
        later = [Job([4], {}, loop)]
        metrics.in_flight = len(jobs) + len(later)
        queue = [jobs[1:], later]
        arrivals = lambda room: queue.pop(0) if queue else []  # noqa: E731
        running: dict = {}
        decode_batch(ScriptedPipe(fail_at=fail_at), jobs[0], requests, arrivals, 4, running)
        heard = [events(loop, job) for job in jobs + later]
    finally:
        loop.close()
    assert metrics.in_flight == 0 and running == {}
    assert heard[1] == ["error"]  # its prefill raised
    assert heard[2] == ["end"] and metrics.cancelled == 1
    # every chunk a request was sent is a round in the engine's log
    assert rounds.stats()["rounds"] == sum(h.count("chunk") for h in heard)
    if fail_at is None:  # rows decode to their end, each its own chunks, then "end"
        assert heard[0] == ["chunk"] * 4 + ["end"]
        assert heard[3] == ["chunk"] * 4 + ["end"]
    else:  # the failing round ends every row in the batch with the error, once
        assert heard[0] == ["chunk", "chunk", "error"]
        assert heard[3] == ["error"]  # taken at that round's boundary, not yet prefilled
        assert metrics.errors.get("generation") == 3
