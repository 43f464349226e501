"""What a request may do to the target's logits before a token is chosen, and what it may read
back: presence/frequency penalties (mlx-lm's own processors) and per-token log-probabilities.

A penalty makes the target's distribution depend on the history, so in a verify forward each
row must see the history *including the drafted prefix before it*; applied that way, speculative
output equals plain decoding with the same processors (mlx-lm's `generate_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence/frequency penalties over the last `*_context_size` tokens (prompt
    included), exactly as mlx-lm (and `mlx_lm.server`) define them."""

    presence: float = 0.0
    frequency: float = 0.0
    presence_context_size: int = 20
    frequency_context_size: int = 20

    def __post_init__(self) -> None:
        for name in ("presence_context_size", "frequency_context_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency)

    @property
    def window(self) -> int:
        return max(self.presence_context_size, self.frequency_context_size)

    def processors(self) -> list[Processor]:
        return make_logits_processors(
            presence_penalty=self.presence or None,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency or None,
            frequency_context_size=self.frequency_context_size,
        )


def process_rows(
    processors: Sequence[Processor],
    history: list[int],
    window: int,
    logits: mx.array,
    drafts: list[int] | mx.array = (),
) -> mx.array:
    """Rows of logits [k+1, V] where row i follows `history + drafts[:i]`; each row is processed
    against its own history (the last `window` tokens are all a processor looks at)."""
    if not processors:
        return logits
    tail = mx.array(history[-window:], dtype=mx.uint32)
    if not isinstance(drafts, mx.array):
        drafts = mx.array(list(drafts), dtype=mx.uint32)
    rows = []
    for i in range(logits.shape[0]):
        tokens = mx.concatenate([tail, drafts[:i].astype(mx.uint32)]) if i else tail
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target, and the top alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def logprob_arrays(logits: mx.array, tokens: mx.array, top: int) -> tuple[mx.array, ...]:
    """Lazy (chosen [T], top ids [T, n], top logprobs [T, n]) from processed logits [T, V]: the
    log-softmax mlx-lm reports, before temperature."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    if top <= 0:
        return (chosen,)
    ids = mx.argsort(-lp, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def token_logprob(logits: mx.array, token: int, top: int) -> TokenLogprob:
    """One position's record for `token` from its processed logits row [V] (a token the
    target did not choose there: a reasoning budget's closing)."""
    arrays = logprob_arrays(logits[None], mx.array([token]), top)
    return read_logprobs(arrays, [token])[0]


def read_logprobs(arrays: tuple[mx.array, ...], tokens: list[int]) -> list[TokenLogprob]:
    """Host-side records for the first len(tokens) rows (after the round's sync)."""
    n = len(tokens)
    chosen = arrays[0][:n].tolist()
    if len(arrays) == 1:
        return [TokenLogprob(t, c, []) for t, c in zip(tokens, chosen)]
    ids, vals = arrays[1][:n].tolist(), arrays[2][:n].tolist()
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids, vals)]
