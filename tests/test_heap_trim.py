"""`HeapTrim`: the server hands glibc's freed heap back to the OS at most once an interval,
and does nothing where the C library has no `malloc_trim`."""

from __future__ import annotations

import platform

from outrider.server import memory
from outrider.server.memory import HeapTrim


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_an_interval():
    clock, calls = Clock(), []
    heap = HeapTrim(every_s=10.0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    assert not heap.maybe()  # the interval runs from when it was made
    clock.now += 9.9
    assert not heap.maybe() and calls == []
    clock.now += 0.2
    assert heap.maybe() and calls == [0] and heap.trims == 1
    clock.now += 5.0
    assert not heap.maybe() and heap.trims == 1
    clock.now += 5.0
    assert heap.maybe() and calls == [0, 0] and heap.trims == 2


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    monkeypatch.setattr(memory, "malloc_trim", lambda: None)
    heap = HeapTrim(every_s=0.0)
    assert not heap.available
    assert not heap.maybe() and heap.trims == 0


def test_glibc_has_one_and_it_runs():
    if platform.libc_ver()[0] != "glibc":  # macOS, musl: `test_without_malloc_trim...` covers it
        assert HeapTrim().available == (memory.malloc_trim() is not None)
        return
    heap = HeapTrim(every_s=0.0)
    assert heap.available
    assert heap.maybe() and heap.trims == 1
