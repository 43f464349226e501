"""Telemetry records: one per speculative round, and the final result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Round:
    drafted: list[int]
    accepted: int
    committed: list[int]
    seconds: float
    ahead: bool = False  # queued before the round before it was read (pipelined), and kept
    dropped: int = 0  # positions of a round queued behind this one, dropped unread


@dataclass
class Result:
    text: str
    prompt_tokens: list[int]
    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    mode: str = ""
    max_draft: int = 0
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (not prefilled)
    auto_cap: bool = False  # the cap was chosen each round (max_draft is then its ceiling)
    calibration: dict | None = None  # the measured costs auto chose from (core/calibration.py)
    plain_steps: int = 0  # one-token target forwards (plain decoding, or auto's parked steps)
    budget_forced: bool = False  # a reasoning budget closed the thinking (core/think_budget.py)

    @property
    def cap_label(self) -> str:
        return f"auto (≤{self.max_draft})" if self.auto_cap else str(self.max_draft)

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per target forward (accepted drafts + 1), averaged over rounds."""
        if not self.rounds:  # plain decoding: one token per target forward
            return 1.0 if self.tokens else 0.0
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)

    @property
    def pipelining(self) -> tuple[int, int]:
        """(rounds queued ahead and kept, rounds queued ahead and dropped): how often a
        pipelined round paid (core/loop.py `decode`)."""
        return sum(r.ahead for r in self.rounds), sum(r.dropped > 0 for r in self.rounds)

    @property
    def target_forwards(self) -> int:
        """Target forwards after the prefill: one a round, one a plain step."""
        return len(self.rounds) + self.plain_steps

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes from the prefill; decode speed counts the rest.
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "rounds": [{"drafted": r.drafted, "accepted": r.accepted} for r in self.rounds],
            "mean_accept_len": round(self.mean_accept_len, 4),
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "peak_memory_gb": round(self.peak_memory_gb, 4),
            "mode": self.mode,
            "max_draft": "auto" if self.auto_cap else self.max_draft,
            "finish_reason": self.finish_reason,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "cached_tokens": self.cached_tokens,
            # rounds queued behind the one in flight and kept / dropped (0 when none)
            "rounds_ahead": self.pipelining[0],
            "rounds_dropped": self.pipelining[1],
            "budget_forced": self.budget_forced,
            **({"calibration": self.calibration} if self.calibration else {}),
        }


def pipelining_fields(ahead: int, dropped: int) -> dict:
    """A receipt's counts of pipelined rounds kept and dropped, where any ran."""
    return {"rounds_ahead": ahead, "rounds_dropped": dropped} if ahead or dropped else {}


def round_dict(r: Round) -> dict:
    return asdict(r)
