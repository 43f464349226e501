"""Greedy output of every mode equals mlx-lm's plain greedy generation, token for token."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.testing import OracleProposer

MODES = [
    ("dspark", "dspark"),
    ("dspark", "dspark-gated"),
    ("dspark", "dspark-rnn"),
    ("dflash", "dflash-deepspec"),
    ("dflash", "dflash-zlab"),
    ("lookup", None),
    ("baseline", None),
]


@pytest.fixture(scope="module")
def pipelines(qwen3_target, drafters):
    out = {}
    for mode, name in MODES:
        out[(mode, name)] = outrider.load(
            str(qwen3_target), None if name is None else str(drafters[name]), mode=mode
        )
    return out


@pytest.mark.parametrize("mode,drafter", MODES)
@pytest.mark.parametrize(
    "cap",
    [1, 4, 8] + [pytest.param(c, marks=pytest.mark.slow) for c in (2, 3, 5, 6, 7)],
)  # the quick tier checks the smallest, the usual and the widest cap; CI checks all
def test_every_mode_every_cap_matches_plain(pipelines, qwen3_target, mode, drafter, cap):
    pipe = pipelines[(mode, drafter)]
    for i, prompt in enumerate(PROMPTS):
        n = (24, 57, 90)[i]
        ids = pipe.encode(prompt)
        want = plain_greedy(qwen3_target, ids, n)
        copies = getattr(pipe.proposer, "lookup_rounds", 0)
        got = pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
        assert got.tokens == want, f"{mode}/{drafter} cap {cap} diverged on prompt {i}"
        assert len(got.tokens) == n
        # only lookup copies (lookup_assist.py) run past a drafter's cap
        limit = min(cap, pipe.proposer.max_draft)
        wide = [r for r in got.rounds if len(r.drafted) > limit]
        if mode != "baseline":
            assert len(wide) <= getattr(pipe.proposer, "lookup_rounds", 0) - copies
        if drafter is not None:  # drafters always fill the cap they are given
            assert max(len(r.drafted) for r in got.rounds if len(r.drafted) <= limit) == limit


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("cap", [1, 4, 8])
def test_oracle_acceptance_rates(pipelines, qwen3_target, rate, cap):
    target = pipelines[("baseline", None)].target
    ids = target.tokenizer.encode("The quick brown fox")
    n = 80
    want = plain_greedy(qwen3_target, ids, n)
    oracle = OracleProposer(ids + want, rate, vocab_size=262, max_draft=8, seed=7)
    pipe = outrider.pipeline_from_parts(target, oracle, "oracle", max_draft=cap)
    got = pipe.generate(ids, max_tokens=n, stop_tokens=set())
    assert got.tokens == want
    accepted = sum(r.accepted for r in got.rounds)
    drafted = sum(len(r.drafted) for r in got.rounds)
    if rate == 1.0:
        assert accepted == drafted  # every draft accepted
        assert got.mean_accept_len > min(cap, 8) * 0.8
    if rate == 0.0:
        assert accepted == 0


@pytest.mark.parametrize("family_fixture", ["llama_target", "qwen2_target"])
@pytest.mark.parametrize("mode", ["dspark", "dflash-zlab", "lookup"])
def test_other_dense_families(request, tmp_path, family_fixture, mode):
    from outrider.testing import make_tiny_drafter

    target = request.getfixturevalue(family_fixture)
    drafter = None
    run_mode = mode
    if mode == "dspark":
        drafter = make_tiny_drafter(tmp_path / "d", target, "dspark", "deepspec")
    elif mode == "dflash-zlab":
        drafter, run_mode = make_tiny_drafter(tmp_path / "d", target, "dflash", "zlab"), "dflash"
    pipe = outrider.load(str(target), None if drafter is None else str(drafter), mode=run_mode)
    for prompt in PROMPTS[:2]:
        ids = pipe.encode(prompt)
        want = plain_greedy(target, ids, 48)
        assert pipe.generate(ids, max_tokens=48, max_draft=4, stop_tokens=set()).tokens == want


def test_long_prompt_crosses_prefill_chunks(qwen3_target, drafters, monkeypatch):
    """Prompts longer than one prefill chunk keep the drafter context and output exact."""
    from outrider.core import target as target_mod

    monkeypatch.setattr(target_mod, "PREFILL_CHUNK", 16)
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    ids = pipe.encode(" ".join(PROMPTS * 3))
    assert len(ids) > 3 * 16
    want = plain_greedy(qwen3_target, ids, 40)
    assert pipe.generate(ids, max_tokens=40, stop_tokens=set()).tokens == want


def test_quantised_and_full_precision_drafters_are_both_lossless(qwen3_target, tmp_path):
    import mlx.nn as nn

    from outrider.testing import make_tiny_drafter

    # rank 128: the Markov tables are quantisable (two groups wide, so on a CUDA GPU too:
    # core/device.py), and the test sees which ones are quantised
    drafter = make_tiny_drafter(tmp_path / "d", qwen3_target, "dspark", markov_rank=128)
    for bits in (16, 8, 4):
        pipe = outrider.load(str(qwen3_target), str(drafter), mode="dspark", drafter_bits=bits)
        head = pipe.proposer.drafter.markov_head
        assert type(head.markov_w1) is nn.Embedding  # one gather a slot, never quantised
        assert isinstance(head.markov_w2, nn.QuantizedLinear) == (bits < 16)
        ids = pipe.encode(PROMPTS[0])
        assert pipe.generate(ids, max_tokens=30, stop_tokens=set()).tokens == plain_greedy(
            qwen3_target, ids, 30
        )


def test_confidence_threshold_truncates_and_stays_lossless(qwen3_target, drafters):
    import mlx.core as mx

    pipe = outrider.load(
        str(qwen3_target),
        str(drafters["dspark"]),
        mode="dspark",
        confidence_threshold=0.5,
        lookup_drafts=False,  # a lookup copy would fill the rounds the threshold cuts
    )
    head = pipe.proposer.drafter.confidence_head.proj
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 40)
    head.bias = mx.array([-30.0])  # confidence ~0: keep the one draft that is always kept
    got = pipe.generate(ids, max_tokens=40, max_draft=8, stop_tokens=set())
    assert got.tokens == want
    assert {len(r.drafted) for r in got.rounds} <= {0, 1}  # 0 only when one token is left
    head.bias = mx.array([30.0])  # confidence ~1: keep the whole block
    got = pipe.generate(ids, max_tokens=40, max_draft=8, stop_tokens=set())
    assert got.tokens == want
    assert max(len(r.drafted) for r in got.rounds) == 8
