"""The last rounds the engine ran, across requests: what `GET /rounds` returns and `GET /events`
streams as they happen (a watcher sees drafting live: which source drafted, how much was
accepted, how long a round took).

The engine's thread appends; HTTP handlers read a copy or subscribe. A subscriber is an asyncio
queue fed with `call_soon_threadsafe`, so the engine never waits for a slow client: a full
queue drops that watcher's oldest events rather than blocking decoding.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

KEEP = 512  # rounds kept for /rounds and for a new watcher's replay
REPLAY = 32  # rounds a new /events watcher gets first
QUEUE = 1024  # events a slow watcher may fall behind by before its oldest are dropped


class RoundLog:
    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._rounds: deque[dict] = deque(maxlen=keep)
        self._seq = 0
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self.rounds_total = 0
        self.tokens_total = 0
        self.drafted_total = 0
        self.accepted_total = 0

    def add(self, request: int, mode: str, index: int, step: Any) -> None:
        """One step of request `request` (its `index`-th): drafted, accepted, committed."""
        with self._lock:
            self._seq += 1
            event = {
                "seq": self._seq,
                "t": round(time.time(), 3),
                "req": request,
                "mode": mode,
                "i": index,
                "source": step.source,
                "drafted": len(step.drafted),
                "accepted": step.accepted,
                "committed": len(step.committed),
                "ms": round(step.seconds * 1000, 2),
            }
            self._rounds.append(event)
            self.rounds_total += 1
            self.tokens_total += len(step.committed)
            if step.source == "draft":
                self.drafted_total += len(step.drafted)
                self.accepted_total += step.accepted
            watchers = list(self._watchers)
        self._tell(watchers, "round", event)

    def prefill(self, request: int, done: int, total: int) -> None:
        """Request `request` has prefilled `done` of its `total` prompt tokens (told to
        watchers only: a long cold prompt otherwise looks like a server that hangs)."""
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "t": round(time.time(), 3), "req": request,
                     "done": done, "total": total}  # fmt: skip
            watchers = list(self._watchers)
        self._tell(watchers, "prefill", event)

    def prefill_of(self, request: int) -> Callable[[int, int], None]:
        """`Pipeline.stream`'s `prefill_progress` for request `request`."""
        return lambda done, total: self.prefill(request, done, total)

    def _tell(self, watchers: list, kind: str, event: dict) -> None:
        for loop, queue in watchers:
            try:
                loop.call_soon_threadsafe(_offer, queue, (kind, event))
            except RuntimeError:  # that watcher's event loop is gone
                self.unsubscribe(queue)

    def snapshot(self, limit: int = 128) -> list[dict]:
        with self._lock:
            return list(self._rounds)[-limit:] if limit > 0 else []

    def stats(self) -> dict[str, Any]:
        with self._lock:
            drafted, accepted = self.drafted_total, self.accepted_total
            return {
                "rounds": self.rounds_total,
                "tokens": self.tokens_total,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": round(accepted / drafted, 4) if drafted else None,
            }

    def subscribe(self) -> tuple[asyncio.Queue, list[dict]]:
        """A queue the next events arrive on, as (kind, event) with kind "round" or "prefill"
        (call from the watcher's event loop), and the last `REPLAY` rounds before it."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE)
        with self._lock:
            self._watchers.append((asyncio.get_running_loop(), queue))
            replay = list(self._rounds)[-REPLAY:]
        return queue, replay

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        with self._lock:
            self._watchers = [(lp, q) for lp, q in self._watchers if q is not queue]

    @property
    def watchers(self) -> int:
        with self._lock:
            return len(self._watchers)


def _offer(queue: asyncio.Queue, event: tuple[str, dict]) -> None:
    """Put without waiting: a watcher that fell `QUEUE` events behind loses its oldest."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(event)
