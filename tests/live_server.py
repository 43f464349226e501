"""A live outrider server on 127.0.0.1 (a free port) in a background thread, for the server
tests: a real uvicorn, a real engine thread, a tiny model."""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import uvicorn

from outrider.server.app import create_app
from outrider.server.engine import Engine, LoadSpec
from outrider.server.generation import Limits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(engine: Engine, timeout: float = 120) -> None:
    end = time.time() + timeout
    while engine.state == "loading" and time.time() < end:
        time.sleep(0.05)
    assert engine.state in ("ready", "no_model"), engine.error


@contextmanager
def live_server(
    spec: LoadSpec | None,
    limits: Limits | None = None,
    api_key: str | None = None,
    loader=None,
    cors_origins: tuple[str, ...] = (),
    max_batch: int = 1,
    load_settings: dict | None = None,
):
    """Yields (base_url, engine); the server and engine stop afterwards."""
    kw = dict(max_batch=max_batch, load_settings=load_settings)
    engine = (Engine(loader, **kw) if loader else Engine(**kw)).start()
    if spec is not None:
        engine.load(spec)
        wait_ready(engine)
        assert engine.state == "ready", engine.error
    app = create_app(engine, limits, api_key, cors_origins=cors_origins)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.time() + 120  # a hang guard, not a timing assertion
    while not server.started and time.time() < end:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


def thread_stacks() -> str:
    """Every thread's stack and the engine's state, for the message of a wait that ran out: a
    hang then says where each thread was."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, ident)}\n{stack}")
    return "\n".join(parts)


def sse_frames(response) -> list[str]:
    """Raw SSE frames (data/event/comment blocks) from a streaming requests response."""
    frames, buf = [], []
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if buf:
                frames.append("\n".join(buf))
                buf = []
        else:
            buf.append(line)
    if buf:
        frames.append("\n".join(buf))
    return frames


def detok(tok, tokens: list[int]) -> str:
    """Text as mlx-lm's own generation shows it (its streaming detokenizer)."""
    d = tok.detokenizer
    d.reset()
    for t in tokens:
        d.add_token(t)
    d.finalize()
    return d.text
