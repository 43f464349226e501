"""What one timed generation leaves behind, and how a suite's runs add up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..core.events import Result, pipelining_fields


@dataclass
class Run:
    """One generation of one prompt by one arm (an outrider mode or an mlx-lm peer).

    `accepts` holds the tokens each target forward committed after the first token (accepted
    drafts + 1); it is empty for plain decoding, which commits one token per forward.
    """

    tokens: list[int]
    ttft_s: float  # prompt in -> first token out (prefill and the first choice)
    decode_s: float  # first token out -> last token out
    accepts: list[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    drafted: int = 0  # tokens committed by drafting rounds (the rest came from plain steps)
    ahead: int = 0  # rounds queued behind the one in flight and kept (pipelined rounds)
    dropped: int = 0  # rounds queued so and dropped unread

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @classmethod
    def from_result(cls, result: Result) -> Run:
        return cls(
            tokens=list(result.tokens),
            ttft_s=result.prefill_seconds,
            decode_s=result.decode_seconds,
            accepts=[r.accepted + 1 for r in result.rounds],
            peak_memory_gb=result.peak_memory_gb,
            drafted=sum(len(r.committed) for r in result.rounds),
            ahead=result.pipelining[0],
            dropped=result.pipelining[1],
        )


def accept_counts(accepts: list[int]) -> list[int]:
    """Rounds by accept length: element k counts the rounds that committed k + 1 tokens (k drafts
    accepted). Empty when there were no rounds (plain decoding)."""
    counts = [0] * max(accepts, default=0)
    for a in accepts:
        counts[a - 1] += 1
    return counts


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Two accept histograms, element by element (the shorter padded with zeros)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class TrialStats:
    """One arm over one suite's prompts in one trial: decode speed is pooled over prompts."""

    decode_tps: float
    accept_len: float
    ttft_s: float
    peak_memory_gb: float
    tokens: int
    accept_counts: list[int] = field(default_factory=list)  # rounds by accept length (above)
    decoded: int = 0  # tokens after the first, over the runs
    drafted: int = 0  # of those, tokens committed by drafting rounds (the rest: plain steps)
    ahead: int = 0  # pipelined rounds kept, over the runs
    dropped: int = 0  # pipelined rounds dropped unread

    @classmethod
    def of(cls, runs: list[Run]) -> TrialStats:
        seconds = sum(r.decode_s for r in runs)
        decoded = sum(r.decode_tokens for r in runs)
        accepts = [a for r in runs for a in r.accepts]
        plain = any(r.tokens for r in runs) and not accepts
        return cls(
            decode_tps=decoded / seconds if seconds > 0 else 0.0,
            accept_len=1.0 if plain else (sum(accepts) / len(accepts) if accepts else 0.0),
            ttft_s=statistics.fmean(r.ttft_s for r in runs) if runs else 0.0,
            peak_memory_gb=max((r.peak_memory_gb for r in runs), default=0.0),
            tokens=sum(len(r.tokens) for r in runs),
            accept_counts=accept_counts(accepts),
            decoded=decoded,
            drafted=sum(r.drafted for r in runs),
            ahead=sum(r.ahead for r in runs),
            dropped=sum(r.dropped for r in runs),
        )


@dataclass
class Cell:
    """One arm on one suite: medians over trials (peak memory: the largest seen)."""

    suite: str
    arm: str
    trials: list[TrialStats]
    speedup: float | None = None  # decode tok/s over baseline's on the same suite, same run

    @property
    def decode_tps(self) -> float:
        return statistics.median(t.decode_tps for t in self.trials)

    @property
    def accept_len(self) -> float:
        return statistics.median(t.accept_len for t in self.trials)

    @property
    def ttft_s(self) -> float:
        return statistics.median(t.ttft_s for t in self.trials)

    @property
    def peak_memory_gb(self) -> float:
        return max(t.peak_memory_gb for t in self.trials)

    @property
    def tokens(self) -> int:
        return self.trials[0].tokens if self.trials else 0

    @property
    def accept_counts(self) -> list[int]:
        """Rounds by accept length over every trial (element k: rounds that accepted k drafts)."""
        counts: list[int] = []
        for t in self.trials:
            counts = add_counts(counts, t.accept_counts)
        return counts

    @property
    def drafted_share(self) -> float | None:
        """The share of decoded tokens that drafting rounds committed, over every trial: how
        much a `--max-draft auto` arm drafted rather than parked. None for a plain arm."""
        decoded = sum(t.decoded for t in self.trials)
        if not decoded or not any(t.accept_counts for t in self.trials):
            return None
        return sum(t.drafted for t in self.trials) / decoded

    def to_json(self) -> dict:
        share = self.drafted_share
        return {
            "suite": self.suite,
            "mode": self.arm,
            "accept_len": round(self.accept_len, 4),
            "decode_tps": round(self.decode_tps, 3),
            "speedup": None if self.speedup is None else round(self.speedup, 4),
            "ttft_s": round(self.ttft_s, 6),
            "peak_memory_gb": round(self.peak_memory_gb, 4),
            "tokens": self.tokens,
            "trials_decode_tps": [round(t.decode_tps, 3) for t in self.trials],
            "accept_counts": self.accept_counts,
            "drafted_share": None if share is None else round(share, 4),
            # pipelined rounds kept and dropped over every trial, where any ran (core/loop.py)
            **pipelining_fields(
                sum(t.ahead for t in self.trials), sum(t.dropped for t in self.trials)
            ),
        }
