"""After zero, partial and full acceptance the target's cache equals a fresh forward's."""

from __future__ import annotations

import mlx.core as mx
import pytest

import outrider
from outrider.core.acceptance import accept_greedy
from outrider.core.sampling import greedy


def cache_arrays(cache) -> list[mx.array]:
    out = []
    for c in cache:
        out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


@pytest.mark.parametrize("accept", ["none", "partial", "full"])
def test_rollback_equals_fresh_forward(qwen3_target, accept):
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    target = pipe.target
    prompt = pipe.encode("Rollback must be exact.")
    cache = target.make_cache()
    logits, _ = target.prefill(prompt, cache)
    anchor = int(mx.argmax(logits).item())
    # the true greedy continuation, to build drafts that are right up to a chosen point
    truth = []
    probe = target.make_cache()
    target.prefill(prompt, probe)
    tok = anchor
    for _ in range(6):
        lg, _ = target.forward(mx.array([tok]), probe)
        tok = int(mx.argmax(lg[-1]).item())
        truth.append(tok)
    k = 6
    right = {"none": 0, "partial": 3, "full": 6}[accept]
    drafts = truth[:right] + [(t + 1) % 262 for t in truth[right:k]]
    logits, _ = target.forward(mx.array([anchor, *drafts]), cache)
    tokens = greedy(logits).tolist()
    a = accept_greedy(tokens, drafts)
    assert a == right
    target.rollback(cache, k - a)
    accepted_text = prompt + [anchor] + drafts[:a]
    fresh = target.make_cache()
    target.forward(mx.array(accepted_text), fresh)
    assert all(c.offset == len(accepted_text) for c in cache)
    for got, want in zip(cache_arrays(cache), cache_arrays(fresh)):
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    # and the next step from the rolled-back cache predicts what the fresh cache predicts
    nxt = tokens[a]
    lg1, _ = target.forward(mx.array([nxt]), cache)
    lg2, _ = target.forward(mx.array([nxt]), fresh)
    assert mx.argmax(lg1[-1]).item() == mx.argmax(lg2[-1]).item()
    assert mx.allclose(lg1, lg2, atol=1e-4).item()
