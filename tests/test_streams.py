"""MLX streams are released by the threads that made them: the server's engine thread as it
ends, the main thread as the interpreter exits. Streams left alive at exit can abort a process
after its work is done (exit status 134; `core/device.py` `release_streams`)."""

from __future__ import annotations

import threading

import outrider
from outrider.core import target as target_module
from outrider.server import engine as engine_module
from outrider.server.engine import Engine


def test_the_engine_thread_releases_its_streams_as_it_ends(monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(
        engine_module, "release_streams", lambda: released.append(threading.current_thread().name)
    )
    engine = Engine(loader=lambda spec: None).start()
    assert released == []
    engine.stop()
    assert released == ["outrider-engine"]


class Registry:
    def __init__(self) -> None:
        self.funcs: list = []

    def register(self, func) -> None:
        self.funcs.append(func)

    def unregister(self, func) -> None:
        self.funcs = [f for f in self.funcs if f is not func]


def test_a_main_thread_stream_is_released_at_exit_once(monkeypatch, qwen3_target):
    registry = Registry()
    monkeypatch.setattr(target_module, "atexit", registry)
    first = outrider.load(str(qwen3_target), mode="baseline").target
    second = outrider.load(str(qwen3_target), mode="baseline").target
    # a load may already run on the stream (a GPU's load probes do): registered once, if so
    made_at_load = list(registry.funcs)
    assert made_at_load in ([], [target_module.release_streams])
    worker = threading.Thread(target=lambda: first.stream)  # another thread's: its own job
    worker.start()
    worker.join()
    assert registry.funcs == made_at_load
    assert first.stream is first.stream  # one a thread, made once
    assert second.stream is not None
    assert registry.funcs == [target_module.release_streams]
