"""Penalties and log-probabilities: speculative output equals mlx-lm's plain penalised decoding."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS

import outrider
from outrider.core.logits import Penalties
from outrider.testing import OracleProposer

PENALTIES = [
    Penalties(presence=1.5),
    Penalties(frequency=0.7, frequency_context_size=64),
    Penalties(presence=0.5, frequency=0.5, presence_context_size=5),
]


def plain_penalised(model_path, ids: list[int], n: int, pen: Penalties, top: int = 0):
    """mlx-lm's generate_step with its own processors: tokens and (logprob, top ids) per token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(str(model_path))
    out, lps = [], []
    steps = generate_step(mx.array(ids), model, max_tokens=n, logits_processors=pen.processors())
    for tok, logprobs in steps:
        out.append(int(tok))
        top_ids = mx.argsort(-logprobs)[:top].tolist() if top else []
        lps.append((logprobs[int(tok)].item(), top_ids))
        if len(out) == n:
            break
    return out, lps


@pytest.fixture(scope="module")
def dspark(qwen3_target, drafters):
    return outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")


@pytest.mark.parametrize("pen", PENALTIES)
def test_penalised_speculation_equals_plain(dspark, qwen3_target, pen):
    ids = dspark.encode(PROMPTS[0])
    want, _ = plain_penalised(qwen3_target, ids, 40, pen)
    unpenalised = dspark.generate(ids, max_tokens=40, stop_tokens=set()).tokens
    assert want != unpenalised  # the penalty matters for this prompt
    got = dspark.generate(ids, max_tokens=40, stop_tokens=set(), max_draft=4, penalties=pen)
    assert got.tokens == want
    # An oracle that drafts the penalised answer is accepted in long blocks, so rows after the
    # first see drafted tokens in their history: the case that breaks if rows share one history.
    oracle = OracleProposer(ids + want, 1.0, vocab_size=268, max_draft=6)
    pipe = outrider.pipeline_from_parts(dspark.target, oracle, "oracle")
    got = pipe.generate(ids, max_tokens=40, stop_tokens=set(), penalties=pen)
    assert got.tokens == want
    assert max(r.accepted for r in got.rounds) >= 5


def test_penalised_baseline_equals_plain(qwen3_target):
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    ids = pipe.encode(PROMPTS[1])
    pen = PENALTIES[0]
    want, _ = plain_penalised(qwen3_target, ids, 30, pen)
    assert pipe.generate(ids, max_tokens=30, stop_tokens=set(), penalties=pen).tokens == want


@pytest.mark.parametrize("mode", ["dspark", "baseline"])
def test_logprobs_are_the_targets(dspark, qwen3_target, mode):
    pipe = dspark if mode == "dspark" else outrider.load(str(qwen3_target), mode="baseline")
    ids = pipe.encode(PROMPTS[2])
    pen = Penalties(presence=0.8)
    want, want_lp = plain_penalised(qwen3_target, ids, 20, pen, top=3)
    chunks = list(pipe.stream(ids, max_tokens=20, stop_tokens=set(), penalties=pen, logprobs=3))
    got = [lp for c in chunks for lp in c.step.logprobs]
    assert [g.token for g in got] == want
    for g, (lp, top_ids) in zip(got, want_lp):
        assert g.logprob == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in g.top] == top_ids
        assert g.top[0][1] >= g.top[1][1] >= g.top[2][1]
        assert g.logprob <= 0
    plain = list(pipe.stream(ids, max_tokens=20, stop_tokens=set(), penalties=pen))
    assert all(c.step.logprobs is None for c in plain)


def test_each_verify_row_is_processed_against_its_own_history():
    """Row i of a verify block follows history + drafts[:i]: the property that makes penalised
    rejection sampling exact too (the acceptor only ever sees these rows)."""
    from outrider.core.logits import process_rows

    pen = Penalties(presence=0.9, frequency=0.4, presence_context_size=6)
    procs = pen.processors()
    history, drafts = [5, 9, 5, 3, 7, 7, 2], [9, 4, 4, 11]
    logits = mx.random.normal((len(drafts) + 1, 16), key=mx.random.key(0))
    got = process_rows(procs, history, pen.window, logits, drafts)
    for i in range(len(drafts) + 1):
        row = logits[i : i + 1]
        for proc in procs:
            row = proc(mx.array(history + drafts[:i]), row)
        assert mx.allclose(got[i], row[0]).item(), f"row {i}"
    assert not mx.allclose(got[0], got[2]).item()  # drafts changed later rows' penalties
