"""mlx-lm's own generation, timed the way outrider's runs are: the peers in every benchmark.

`mlx_lm_plain` is mlx-lm's pipelined `generate_step`; `mlx_lm_speculative` is mlx-lm's own
speculative decoding with a small draft model (`speculative_generate_step`). Both stop where
outrider stops: at a stop token (not emitted) or after `max_tokens` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn

from ..core.errors import OutriderError
from ..core.hub import resolve_model
from .records import Run


def _timed(steps: Iterable[tuple[int, bool]], max_tokens: int, stop: set[int]) -> Run:
    """Collect (token, from_draft) pairs into a Run; the clock starts when this is called."""
    t0 = time.perf_counter()
    tokens: list[int] = []
    accepts: list[int] = []
    drafted_run = 0
    first = last = None
    for token, from_draft in steps:
        last = time.perf_counter()
        if first is None:
            first = last
        if token in stop:
            break
        tokens.append(token)
        if from_draft:
            drafted_run += 1
        else:  # the target's own token closes a speculative round
            accepts.append(drafted_run + 1)
            drafted_run = 0
        if len(tokens) >= max_tokens:
            break
    if drafted_run:
        accepts.append(drafted_run)
    ttft = (first - t0) if first is not None else 0.0
    decode = (last - first) if first is not None else 0.0
    # a speculative peer runs rounds only: every token after the first came from one
    drafted = max(len(tokens) - 1, 0) if accepts else 0
    return Run(tokens, ttft, decode, accepts, mx.get_peak_memory() / 1e9, drafted)


def mlx_lm_plain(model: nn.Module, prompt: list[int], max_tokens: int, stop: set[int]) -> Run:
    """mlx-lm's plain greedy generation of `prompt` (one token per forward)."""
    from mlx_lm.generate import generate_step

    mx.reset_peak_memory()
    gen = generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens)
    try:
        run = _timed(((int(t), False) for t, _ in gen), max_tokens, stop)
    finally:
        gen.close()
    run.accepts, run.drafted = [], 0  # plain decoding: one token per forward, as baseline
    return run


def mlx_lm_speculative(
    model: nn.Module,
    draft_model: nn.Module,
    prompt: list[int],
    max_tokens: int,
    stop: set[int],
    num_draft: int,
) -> Run:
    """mlx-lm's own speculative decoding (greedy) with `draft_model` proposing `num_draft`."""
    from mlx_lm.generate import speculative_generate_step

    mx.reset_peak_memory()
    gen = speculative_generate_step(
        mx.array(prompt, dtype=mx.uint32),
        model,
        draft_model,
        num_draft_tokens=num_draft,
        max_tokens=max_tokens,
    )
    try:
        return _timed(((int(t), bool(d)) for t, _, d in gen), max_tokens, stop)
    finally:
        gen.close()


def load_draft_model(name: str, target_vocab: int | None) -> nn.Module:
    """A draft model for mlx-lm's speculative decoding; it must share the target's vocabulary."""
    from mlx_lm.utils import load as mlx_lm_load

    from ..core.checkpoint import read_config

    path = resolve_model(name, "peer draft model")
    vocab = read_config(path).get("vocab_size")
    if target_vocab and vocab and int(vocab) != int(target_vocab):
        raise OutriderError(
            f"--peer-draft-model {name} has a vocabulary of {vocab} tokens, the target "
            f"{target_vocab}: mlx-lm's speculative decoding needs the same tokenizer"
        )
    try:
        model, _ = mlx_lm_load(str(path))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OutriderError(f"could not load --peer-draft-model {name}: {first}") from e
    return model
