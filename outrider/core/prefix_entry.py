"""One prefix-cache entry: a sequence's cache, its checkpoints, taps and logits rows, what of
it a hit can restore, and how it is thinned to fit a budget (core/prefix_cache.py keeps them,
core/prefix_disk.py writes them to files)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .family import LayerSnapshot


@dataclass
class Entry:
    """One cached sequence: the cache at its end (`final`), snapshots of what cannot be cut
    back at checkpoints along it, the drafter's taps, and the target's logits rows where a
    prompt ended."""

    tokens: np.ndarray
    final: list[LayerSnapshot]
    checkpoints: dict[int, list[LayerSnapshot | None]] = field(default_factory=dict)
    taps: mx.array | None = None
    tap_ids: tuple[int, ...] = ()
    logits: dict[int, mx.array] = field(default_factory=dict)  # position -> logits row there
    marks: set[int] = field(default_factory=set)  # checkpoints later requests share: kept last

    def __post_init__(self) -> None:
        self.all_trimmable = all(s.trimmable for s in self.final)
        self.nbytes = (
            self._count()
        )  # `PrefixCache._absorb`, the one change an entry sees, recounts it

    def _count(self) -> int:
        n = sum(s.nbytes for s in self.final)
        n += sum(s.nbytes for ck in self.checkpoints.values() for s in ck if s is not None)
        n += sum(row.nbytes for row in self.logits.values())
        return n + (self.taps.nbytes if self.taps is not None else 0)

    def usable(self, shared: int) -> int:
        """The longest restorable prefix of at most `shared` tokens."""
        if self.all_trimmable:
            return shared
        positions = [p for p in (*self.checkpoints, len(self.tokens)) if p <= shared]
        return max(positions, default=0)

    def whole(self, n: int) -> bool:
        """Whether a prompt of n tokens held here can start with no forward at all: its
        last position's logits are kept, and the cache restores to exactly n."""
        return n in self.logits and self.usable(n) == n

    def thin(self, limit: int) -> int:
        """Drop checkpoints until the entry holds at most `limit` bytes, or none is left;
        returns how many went. A hit then resumes from an earlier checkpoint: more to prefill,
        never another answer.

        A recurrent layer's snapshot weighs the same wherever it is taken (a 27B hybrid's, a
        hundred megabytes or more), so a long agent conversation's checkpoints, one every
        `interval` tokens of every turn, outgrow any budget. First to go are those where no
        prompt ended nor a caller's mark sits (`Record.marks`: where a system prompt or a
        message ended), the one nearest the checkpoint before it first, so the rest stay spread
        along the sequence; then those, oldest first, but the first mark (a system prompt's end,
        which new conversations share) and the newest (where the next turn resumes) go last."""
        dropped = 0
        while self.nbytes > limit and self.checkpoints:
            positions = sorted(self.checkpoints)
            gaps = {p: p - before for before, p in zip([0, *positions], positions)}
            loose = [p for p in positions if p not in self.logits and p not in self.marks]
            marks = sorted(self.marks & set(positions))
            last = [*marks[:1], positions[-1]]
            kept = [p for p in positions if p not in last] or last
            victim = min(loose, key=lambda p: (gaps[p], p)) if loose else kept[0]
            del self.checkpoints[victim]
            self.logits.pop(victim, None)  # no whole hit there without its checkpoint
            self.nbytes = self._count()
            dropped += 1
        return dropped

    def layers(self, n: int) -> list[LayerSnapshot]:
        if self.all_trimmable or n == len(self.tokens):
            return self.final
        ck = self.checkpoints[n]
        return [f if c is None else c for c, f in zip(ck, self.final, strict=True)]


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:  # most entries of a busy store share nothing with a prompt
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def entry_key(identity: str, tokens: np.ndarray) -> str:
    """A file stem for a sequence of `identity`'s model (the disk tier's)."""
    h = hashlib.sha256(identity.encode())
    h.update(tokens.astype(np.int64).tobytes())
    return h.hexdigest()[:40]
