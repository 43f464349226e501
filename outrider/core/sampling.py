"""Sampling parameters and the target/draft distributions they define.

Greedy decoding (temperature 0) uses the raw argmax, exactly as mlx-lm does. Sampled decoding
turns logits into a probability distribution with temperature, then top-k, then top-p; the same
transform is applied to draft logits so draft and target distributions live on the same support.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy(logits: mx.array) -> mx.array:
    """Argmax of the log-probabilities in the logits' own dtype, exactly as mlx-lm's greedy
    sampler sees them: in bf16 the subtraction can round near-equal logits into a tie, and the
    tie must break the way plain mlx-lm decoding breaks it."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Rows of logits [..., V] -> rows of probabilities after temperature, top-k and top-p."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k : vocab - params.top_k + 1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """Draw one index per row from rows of probabilities (zero rows never occur here)."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


class KeyStream:
    """Deterministic per-request random keys (no global RNG state)."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = int.from_bytes(__import__("os").urandom(4), "little")
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub
