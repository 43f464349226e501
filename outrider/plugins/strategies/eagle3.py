"""EAGLE-3: a one-layer autoregressive drafter over fused target taps, chained step by step.

Bookkeeping as in deepseek-ai/DeepSpec `deepspec/eval/eagle3/evaluator.py`: context row t pairs
the target's taps at position t with token t+1 at RoPE position t (it predicts token t+2). A
round first adds the rows the last verification committed (their taps came back with it; the
last row needs the new anchor, so rows are added when drafting, not when observing), reads the
first draft off the last row, then chains single-token steps that feed the drafter's own output
hidden with the token just drafted. Those speculative rows leave the cache (a trim) when the
round's verification is observed, so the cache only ever holds committed context.
"""

from __future__ import annotations

import mlx.core as mx

from ...core.draft_vocab import DraftVocab
from ...core.drafter_spec import DrafterSpec
from ...core.errors import OutriderError
from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.sampling import probabilities, sample
from ...core.target import Target
from .eagle3_drafter import Eagle3Drafter, load_eagle3_drafter

# A chain can run past the depth it was trained for (ttt_length); acceptance just decays.
MAX_CHAIN = 16


class Eagle3Proposer:
    def __init__(self, name: str, target: Target, drafter: Eagle3Drafter) -> None:
        spec = drafter.spec
        self.name = name
        self.drafter = drafter
        self.spec = spec
        self.tap_layer_ids = tuple(spec.target_layer_ids)
        self.max_draft = max(MAX_CHAIN, spec.ttt_length)
        self.vocab = DraftVocab(spec.weights.get("d2t"), spec.vocab_size)
        self._embed = drafter.embed_tokens if spec.own_embedding else target.embed
        self._head = drafter.lm_head if spec.own_lm_head else target.project
        self._cache = drafter.make_cache()
        self._pending: list[mx.array] = []  # taps of committed rows not yet in the cache
        self._speculative = 0  # chained rows the last round appended (trimmed on observe)
        self._last: mx.array | None = None  # output of the newest committed row
        self._drafted: mx.array | None = None  # the last round's drafts
        # a round drafted ahead: the committed rows before it, its round's rows, `_last` before
        self._ahead: tuple[int, int, mx.array | None] | None = None

    @property
    def cached_rows(self) -> int:
        """Rows in the drafter's cache (committed context, plus a round's chained steps)."""
        return self._cache[0].offset

    @property
    def context_rows(self) -> int:
        """Committed rows the drafter knows: cached, or waiting for their next token."""
        return self.cached_rows - self._speculative + sum(t.shape[0] for t in self._pending)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._cache = self.drafter.make_cache()
        self._pending = [] if taps is None else [taps]
        self._speculative = 0
        self._last = None
        self._drafted, self._ahead = None, None

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        if self._ahead is not None:  # a round was drafted ahead on this round's rows
            (committed, rows, last), self._ahead = self._ahead, None
            if taps is not None and taps.shape[0] == rows:
                return  # kept: its rows are committed context, its chain the next round's
            extra = self.cached_rows - committed  # dropped: back to the context before them
            for c in self._cache:
                c.trim(extra)
            self._speculative, self._last = 0, last
        if self._speculative:
            for c in self._cache:
                c.trim(self._speculative)
            self._speculative = 0
        if taps is not None:
            self._pending.append(taps)

    def add_rows(self, taps: mx.array) -> None:
        """Context rows of tokens observed without them (a parked run's, recomputed): taken
        in with the next drafting call, after those observed before."""
        self._pending.append(taps)

    def _catch_up(self, tokens: list[int]) -> mx.array:
        """Add the pending rows (taps t paired with token t+1); the newest row's output."""
        start = self.cached_rows
        rows = sum(t.shape[0] for t in self._pending)
        if start + rows != len(tokens) - 1:
            raise RuntimeError(
                f"EAGLE-3 context out of step: {start} cached + {rows} pending rows for "
                f"{len(tokens)} tokens"
            )
        if rows == 0:
            if self._last is None:
                raise RuntimeError("EAGLE-3 proposer has no context (start was not called)")
            return self._last
        taps = self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending)
        self._pending = []
        ids = mx.array(tokens[start + 1 :], dtype=mx.uint32)
        h = self.drafter.step(self._embed(ids)[None], self.drafter.project(taps), self._cache)
        self._last = h[:, -1:]
        return self._last

    def propose(self, ctx: DraftContext) -> Proposal:
        cap = min(ctx.cap, self.max_draft)
        if cap <= 0:
            return Proposal.empty()
        return self._chain(self._catch_up(ctx.tokens), cap, ctx)

    def draft_ahead(self, ctx: DraftContext, anchor: mx.array, taps: mx.array) -> Proposal | None:
        """The next round's drafts before this round is read (pipelined rounds, core/loop.py),
        assuming it keeps all its drafts: its chain's rows leave the cache as observing it
        would make them, its rows join the context paired with its drafts and `anchor` (the
        target's token after them, not computed yet), and the chain goes on from there.
        `observe` keeps all that when the round kept every draft, and trims it back to the
        committed context otherwise. Greedy only."""
        cap = min(ctx.cap, self.max_draft)
        drafted = self._drafted
        if (
            self._ahead is not None
            or self._pending
            or not ctx.sampling.greedy
            or cap <= 0
            or drafted is None
            or drafted.shape[0] + 1 != taps.shape[0]
        ):
            return None
        for c in self._cache:
            c.trim(self._speculative)
        self._speculative = 0
        ahead = (self.cached_rows, taps.shape[0], self._last)
        ids = mx.concatenate([drafted, anchor.reshape(1).astype(mx.uint32)])
        h = self.drafter.step(self._embed(ids)[None], self.drafter.project(taps), self._cache)
        self._last = h[:, -1:]
        proposal = self._chain(self._last, cap, ctx)
        self._ahead = ahead
        return proposal

    def _chain(self, h: mx.array, cap: int, ctx: DraftContext) -> Proposal:
        """`cap` drafts chained from the newest context row's output `h`."""
        greedy = ctx.sampling.greedy
        keys = None if greedy else mx.random.split(ctx.key, cap)
        tokens, probs = [], []
        for i in range(cap):
            logits = self._head(self.drafter.head_input(h[0])).astype(mx.float32)  # [1, Vd]
            if greedy:
                draft = mx.argmax(logits, axis=-1)
            else:
                q = probabilities(logits, ctx.sampling)
                draft = sample(q, keys[i])
                probs.append(self.vocab.widen(q)[0])
            token = self.vocab.to_target(draft)
            tokens.append(token)
            if i + 1 < cap:
                h = self.drafter.step(self._embed(token)[None], h, self._cache)
        self._speculative = cap - 1
        self._drafted = mx.concatenate(tokens).astype(mx.uint32)
        return Proposal(self._drafted, cap, probs=mx.stack(probs) if probs else None)


class Eagle3:
    name = "eagle3"
    description = "EAGLE-3 drafter: one layer over fused target taps, chained token by token"
    needs_drafter = True
    default_cap = 7  # DeepSpec's ttt_length

    def build(self, target: Target, drafter: DrafterSpec | None, options: dict) -> Eagle3Proposer:
        if drafter is None:
            raise OutriderError("--mode eagle3 needs an EAGLE-3 drafter (--drafter)")
        if drafter.kind != "eagle3":
            raise OutriderError(
                f"this drafter is a {drafter.kind} drafter, not an EAGLE-3 one; use --mode "
                f"{drafter.kind}"
            )
        model = load_eagle3_drafter(drafter, bits=options.get("drafter_bits", 4))
        return Eagle3Proposer(self.name, target, model)


@hookimpl
def register_strategies(register):
    register(Eagle3())
