"""What a drafting strategy hands the loop each round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import mlx.core as mx

from .sampling import SamplingParams


@dataclass
class Proposal:
    """k drafted tokens. `tokens` may stay lazy on the device; `k` is known on the host.

    `probs` [k, V] is the distribution each draft was sampled from (None: chosen
    deterministically, i.e. one-hot); `confidence` [k] is the drafter's own per-slot estimate.
    `copied` marks a lookup copy standing in for the drafter's block: what it accepts says
    nothing about the drafter, so the cap policies learn nothing from it. `forced` marks tokens
    the engine commits whatever the target says (a reasoning budget's closing,
    core/think_budget.py): the round forwards them and keeps them all.
    """

    tokens: mx.array
    k: int
    probs: mx.array | None = None
    confidence: mx.array | None = None
    host: list[int] | None = None  # the same ids on the host, when the proposer made them there
    copied: bool = False
    forced: bool = False

    @classmethod
    def empty(cls) -> Proposal:
        return cls(tokens=mx.zeros((0,), dtype=mx.uint32), k=0, host=[])

    @classmethod
    def from_list(cls, ids: list[int], copied: bool = False, forced: bool = False) -> Proposal:
        tokens = mx.array(ids, dtype=mx.uint32)
        return cls(tokens=tokens, k=len(ids), host=list(ids), copied=copied, forced=forced)

    def first(self, n: int) -> Proposal:
        """The first n drafts (all of them when n >= k), with their q rows and confidences:
        a cut that looks only at drafts before the ones it drops keeps sampling exact."""
        if n >= self.k:
            return self
        if n <= 0:
            return Proposal.empty()
        return Proposal(
            self.tokens[:n],
            n,
            probs=None if self.probs is None else self.probs[:n],
            confidence=None if self.confidence is None else self.confidence[:n],
            host=None if self.host is None else self.host[:n],
            copied=self.copied,
        )


@dataclass
class DraftContext:
    """What the proposer may look at when drafting one round."""

    tokens: list[int]  # prompt + committed tokens, ending with the anchor
    cap: int  # at most this many drafts
    sampling: SamplingParams
    key: mx.array | None = None  # random key for sampled drafting
    extras: dict = field(default_factory=dict)


@runtime_checkable
class Proposer(Protocol):
    """A drafting strategy bound to one target for one generation.

    `tap_layer_ids` lists the target layers whose raw outputs the proposer wants (DeepSpec
    convention: id j is the output of decoder layer j, -1 the embedding output); empty for
    drafter-free strategies. A proposer that drafts on the host in microseconds may say
    `drafts_on_host = True`: while `--max-draft auto` has parked speculation, the loop then asks
    it for drafts it does not verify and checks them against the tokens that follow, so the
    policy keeps learning acceptance for free (`core/schedule.py`); it asks
    `propose_host(ctx) -> list[int]` where the proposer has it (the same drafts as `propose`,
    as host ids only: no device array made on every plain step), else `propose(ctx).host`. A proposer that can tell
    cheaply whether it holds a lookup copy of the context may offer `copy_ready(tokens, room)`
    (the copy's drafts, 0 for none) and `copy_rate` (the share of a copy's drafts its rounds
    keep): a parked `auto` then asks it after every plain step and verifies the copy when the
    tokens it should commit pay for the round (`plugins/strategies/lookup_assist.py`).

    A proposer that drafts on the host may offer `propose_ahead(ctx) -> Proposal`: its guess,
    without changing its state, of the tokens after `ctx.tokens` (the history and a round's
    drafts that are not verified yet): the first is the token the target should choose next,
    the rest (at most `ctx.cap - 1`) drafts after it, `host` set; empty when it has no guess.
    Greedy decoding then queues the next round on that guess while this one runs
    (`core/loop.py`, pipelined rounds). A model drafter may offer `draft_ahead(ctx, anchor,
    taps) -> Proposal | None` instead: the next round's drafts from the round in flight's
    hidden states and the target's token after its drafts, both arrays not yet computed,
    assuming that round keeps every draft; its `observe` then keeps what it took in when the
    round did, and drops it when not (`plugins/strategies/block_proposer.py`).

    A proposer with taps may offer `add_rows(taps)`: the rows of tokens it has already
    observed without them (`observe(0, None)`), computed later in one forward. A long parked
    run on a GPU then forwards no taps and recomputes them where it ends (`core/parked.py`,
    `plain_run`), since there a step's time is the host's and the taps' join costs ~3% of a
    small target's step.

    A proposer that learns as it goes may offer `snapshot() -> dict`: what it has learnt, for a
    benchmark receipt (lookup's copies by match kind; `benchmark/runner.py`).
    """

    name: str
    tap_layer_ids: tuple[int, ...]
    max_draft: int

    def start(self, prompt: list[int], taps: mx.array | None) -> None: ...

    def propose(self, ctx: DraftContext) -> Proposal: ...

    def observe(self, accepted: int, taps: mx.array | None) -> None: ...


def propose_all(proposers: list[Proposer], ctxs: list[DraftContext]) -> list[Proposal]:
    """One round's proposal of every row: rows whose proposers share a `rows_key` in one
    `propose_rows` call (the first one's), every other proposer on its own (and only when its
    cap is above 0)."""
    out: list[Proposal | None] = [None] * len(proposers)
    together: dict = {}
    for i, (proposer, ctx) in enumerate(zip(proposers, ctxs, strict=True)):
        key = getattr(proposer, "rows_key", None)
        if key is not None:
            together.setdefault(key, []).append(i)
        else:
            out[i] = proposer.propose(ctx) if ctx.cap > 0 else Proposal.empty()
    for rows in together.values():
        first = proposers[rows[0]]
        got = first.propose_rows([proposers[i] for i in rows], [ctxs[i] for i in rows])
        for i, proposal in zip(rows, got, strict=True):
            out[i] = proposal
    return out
