"""Draft-model speculation: a small causal LM with the target's tokenizer drafts token by token.

This is the classic pairing mlx-lm runs as `mlx_lm.generate --draft-model M --num-draft-tokens
k` (ml-explore/mlx-lm `mlx_lm/generate.py`, `speculative_generate_step`): the draft model decodes
k tokens autoregressively on its own cache, the target verifies them in one forward, and the
draft cache keeps the committed tokens only. mlx-lm trims both caches and so needs trimmable
ones; here the draft model is loaded as an outrider `Target`, and a layer whose cache cannot be
trimmed (a sliding window, a recurrent state) is snapshotted before the draft steps and put
back after them, so any family the target plugins load can draft.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ...core.errors import OutriderError, UnsupportedTargetError
from ...core.family import LayerSnapshot, NotSnapshottable
from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.sampling import greedy, probabilities, sample
from ...core.target import Target
from ..targets.caches import restore_layer, snapshot_layer

MAX_DRAFT = 16  # the most tokens one round drafts; mlx-lm's CLI default is 3


def vocab_size(model: Target) -> int:
    """The width of a model's logits (config `vocab_size`, else one probe forward)."""
    cfg = model.config
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if size:
        return int(size)
    logits, _ = model.forward(mx.array([0], dtype=mx.uint32), model.make_cache())
    return int(logits.shape[-1])


def check_tokenizers(target: Target, draft: Target, draft_name: str = "the draft model") -> None:
    """Refuse a draft model whose tokenizer gives any shared id another token than the
    target's: its drafts would be the wrong tokens and almost never accepted.

    A tokenizer with a few more or fewer added tokens, or logits padded to another width
    (Qwen2.5 0.5B has 151936 rows, 7B 152064), is fine: drafts are kept inside the target's
    vocabulary, and target tokens the draft model has no row for are never fed to it as such.
    """
    want = _id_to_token(target.tokenizer)
    have = _id_to_token(draft.tokenizer)
    if not want or not have:
        raise OutriderError(
            f"{draft_name} or the target has no readable tokenizer vocabulary; draft mode "
            "needs both to check they share one"
        )
    shared = want.keys() & have.keys()
    differ = [i for i in shared if want[i] != have[i]]
    if differ or not shared:
        i = min(differ) if differ else 0
        raise OutriderError(
            f"{draft_name} has another tokenizer than the target ({len(differ)} of "
            f"{len(shared)} shared ids differ, e.g. id {i}: {have.get(i)!r} vs "
            f"{want.get(i)!r}); --mode draft needs a draft model with the target's tokenizer"
        )


def _id_to_token(tokenizer: Any) -> dict[int, str]:
    vocab = getattr(tokenizer, "get_vocab", None)
    if tokenizer is None or vocab is None:
        return {}
    return {int(i): t for t, i in vocab().items()}


def _trimmable(cache: Any) -> bool:
    """A layer cache whose last rows can be dropped after any number of forwards."""
    return type(cache) in (KVCache, QuantizedKVCache)


class DraftModelProposer:
    """Drafts with a small model that keeps its own cache equal to the committed tokens.

    Between rounds the draft cache holds a prefix of the committed tokens (`_seen`); each
    `propose` first feeds the committed tokens it has not seen (the last round's bonus token,
    and its last accepted draft when every draft was accepted, or the tokens of plain steps),
    then draws one token per forward. `observe` drops the rejected drafts again: trimmable
    layers trim them, the others get back the snapshot taken before the draft steps.
    """

    name = "draft"
    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, draft: Target, target_vocab: int, max_draft: int = MAX_DRAFT) -> None:
        self.draft = draft
        self.max_draft = max_draft
        self._target_vocab = target_vocab
        self._draft_vocab = vocab_size(draft)
        self._width = min(target_vocab, self._draft_vocab)  # ids a draft may take
        self._cache: list = []
        self._seen: list[int] = []
        self._checked = 0  # _seen[:_checked] are known to be committed tokens
        self._pending: tuple[int, mx.array, list[LayerSnapshot | None]] | None = None
        self._snapshot(draft.make_cache())  # a cache kind with no rollback is refused now

    def fork(self) -> DraftModelProposer:
        """A proposer for another row: the same draft model, its own cache."""
        return DraftModelProposer(self.draft, self._target_vocab, self.max_draft)

    @property
    def cache(self) -> list:
        """The draft model's cache (tests compare its length with the committed tokens)."""
        return self._cache

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens the draft cache holds, in order."""
        return list(self._seen)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._cache = self.draft.make_cache()
        self._seen = []
        self._checked = 0
        self._pending = None
        if len(prompt) > 1:  # the last prompt token goes in with the first round's catch-up
            self.draft.prefill(self._inputs(prompt[:-1]), self._cache)
            self._seen = list(prompt[:-1])

    def propose(self, ctx: DraftContext) -> Proposal:
        unseen = self._catch_up(ctx.tokens)
        k = ctx.cap
        keys = None if ctx.sampling.greedy else mx.random.split(ctx.key, k)
        logits, _ = self.draft.forward(mx.array(self._inputs(unseen), dtype=mx.uint32), self._cache)
        self._seen.extend(unseen)
        self._checked = len(self._seen)
        before = self._snapshot(self._cache) if k > 1 else []
        tokens, probs = [], []
        for i in range(k):
            if i:
                logits, _ = self.draft.forward(tokens[-1].reshape(1), self._cache)
            row = logits[-1, : self._width]
            if keys is None:
                token = greedy(row)
            else:
                q = probabilities(row, ctx.sampling)
                token = sample(q, keys[i])
                probs.append(q)
            tokens.append(token.astype(mx.uint32))
            mx.async_eval(tokens[-1])  # computes while the next step's graph is built
        drafts = mx.stack(tokens)
        self._pending = (k, drafts, before)
        q = None
        if probs:
            q = mx.stack(probs)
            if self._width < self._target_vocab:  # q is zero on ids the draft model lacks
                q = mx.pad(q, [(0, 0), (0, self._target_vocab - self._width)])
        return Proposal(tokens=drafts, k=k, probs=q)

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        if self._pending is None:  # a plain step: its token is fed at the next catch-up
            return
        k, drafts, before = self._pending
        self._pending = None
        fed = k - 1  # the last draft was drawn but never fed
        keep = min(accepted, fed)
        if keep < fed and any(s is not None for s in before):
            # a snapshot restores the state before every draft: the kept drafts go back in
            # with the next catch-up (they are committed tokens by then)
            self._restore(fed, before)
            return
        if keep < fed:
            for c in self._cache:
                c.trim(fed - keep)
        self._seen.extend(drafts.tolist()[:keep])  # evaluated by the round's sync

    # -- the draft cache ----------------------------------------------------------------------
    def _catch_up(self, tokens: list[int]) -> list[int]:
        """The committed tokens the draft cache lacks (never empty: the anchor is new).

        The cache holds a prefix of `tokens` whenever rounds follow each other (only what
        was added since the last round is compared); if it ever does not (a caller that
        rewrote history), it is rebuilt from scratch."""
        n, done = len(self._seen), self._checked
        if n >= len(tokens) or tokens[done:n] != self._seen[done:]:
            self.start(tokens, None)
            n = len(self._seen)
        return tokens[n:]

    def _inputs(self, ids: list[int]) -> list[int]:
        """Ids the draft model can embed: a target id past its rows (padding the draft model
        lacks) goes in as id 0; that only changes drafts, never what is accepted."""
        top = self._draft_vocab
        return [i if i < top else 0 for i in ids]

    def _snapshot(self, cache: list) -> list[LayerSnapshot | None]:
        """Copies of the layers that cannot be trimmed (None for those that can)."""
        try:
            return [None if _trimmable(c) else snapshot_layer(c) for c in cache]
        except NotSnapshottable as e:
            raise UnsupportedTargetError(
                f"the draft model's cache cannot be rolled back ({e}); --mode draft needs a "
                "draft model with KV, sliding-window or recurrent caches"
            ) from None

    def _restore(self, fed: int, before: list[LayerSnapshot | None]) -> None:
        """Put every layer back to the state right after the catch-up: trimmable layers drop
        the `fed` drafts, the others take their snapshot back."""
        n = len(self._seen)
        for c, snap in zip(self._cache, before):
            if snap is None:
                c.trim(fed)
            else:
                restore_layer(c, snap, n)


class DraftModel:
    name = "draft"
    description = "a small mlx-lm model with the target's tokenizer drafts token by token"
    needs_drafter = False
    default_cap = 3  # mlx-lm's --num-draft-tokens default

    def build(self, target: Target, drafter: Any | None, options: dict) -> DraftModelProposer:
        draft = options.get("draft_model")
        if not isinstance(draft, Target):
            raise OutriderError(
                "--mode draft needs a draft model: pass --draft-model M (a small mlx-lm model "
                "with the target's tokenizer)"
            )
        check_tokenizers(target, draft, options.get("draft_model_name") or "the draft model")
        return DraftModelProposer(draft, vocab_size(target))


@hookimpl
def register_strategies(register):
    register(DraftModel())
