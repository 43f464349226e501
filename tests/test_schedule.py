"""`--max-draft auto`: the cap policy picks what measured costs and acceptance say is fastest,
parks speculation when plain decoding is faster, and never changes a token."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import loop
from outrider.core.schedule import AutoCap
from outrider.testing import OracleProposer


def trained(ceiling: int, cost, accept: float) -> AutoCap:
    """A policy that has seen rounds at every cap with these costs and this acceptance."""
    policy = AutoCap(ceiling)
    for _ in range(20):
        for k in range(ceiling + 1):
            accepted = 0
            while accepted < k and (accepted + 1) / (k + 1) <= accept:
                accepted += 1
            policy.observe(k, accepted, cost(k))
    policy.accept = [accept] * ceiling
    return policy


def test_cheap_verify_and_good_drafts_take_the_whole_block():
    policy = trained(6, lambda k: 1.0 + 0.02 * k, 0.9)
    assert policy.choose(100) == 6


def probe_gaps(policy: AutoCap, steps: int = 600) -> tuple[list[int], list[int]]:
    """(the caps of the probes, the plain steps between them) over `steps` steps."""
    plan = []
    while len(plan) < steps:
        k = policy.choose(100)
        plan += [k] if k else [0] * policy.plain_run(100)
    probes = [i for i, k in enumerate(plan) if k]
    return [plan[i] for i in probes], [b - a - 1 for a, b in zip(probes, probes[1:])]


def test_verify_cost_growing_per_row_parks_speculation_and_probes_again():
    """Each verify row costing as much as a plain step (a compute-bound CPU) and acceptance of
    one half: no cap beats plain decoding, so the generation takes runs of plain steps, with a
    one-draft probe after each run. The runs double while the probes say no, up to where a
    failed probe (one plain step's time lost) costs 3% of the run: 33 steps."""
    caps, gaps = probe_gaps(trained(6, lambda k: 1.0 + 1.0 * k, 0.5))
    assert caps and set(caps) == {1}
    assert gaps[:3] == [32, 33, 33] and set(gaps[1:]) == {33}


def test_a_costly_probe_waits_longer():
    """A drafter call worth ten plain steps (a drafter on a CPU): runs double to the ceiling."""
    caps, gaps = probe_gaps(trained(6, lambda k: 1.0 + 10.0 * k, 0.05), steps=1200)
    assert set(caps) == {1}
    assert gaps[:4] == [32, 64, 128, 256] and set(gaps[3:]) == {256}


def test_an_intermediate_cost_picks_an_intermediate_cap():
    policy = trained(8, lambda k: 1.0 + 0.25 * k, 0.7)
    # E(k) / c(k) with s_j = 0.7^j: best at k = 2 (1.19 tokens per unit, vs 1.0 plain)
    assert policy.choose(100) == 2
    assert policy.choose(1) == 1  # never more than the tokens left


def test_unmeasured_caps_are_read_off_the_line_through_measured_ones():
    policy = AutoCap(8)
    for _ in range(10):
        policy.observe(0, 0, 1.0)
        policy.observe(4, 2, 3.0)
    assert policy.cost(2) == pytest.approx(2.0)
    assert policy.cost(8) == pytest.approx(5.0)


def test_the_first_rounds_draft_at_the_start_cap_then_measure_plain_steps():
    policy = AutoCap(8, start=4)
    first = []
    for _ in range(12):
        k = policy.choose(100)
        first.append(k)
        policy.observe(k, min(k, 1), 1.0 + k)
        if k == 0:
            policy.plain_run(1)
    assert first[:4] == [4] * 4 and 0 in first[4:]


@pytest.mark.parametrize("accept_rate", [1.0, 0.6])
def test_auto_output_equals_plain_greedy(qwen3_target, monkeypatch, accept_rate):
    """Whatever caps the policy picks round by round (here: parked, probing, then drafting,
    forced by a policy whose costs flip halfway), the tokens are plain greedy decoding's."""
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 60)
    vocab = pipe.target.config["vocab_size"]
    oracle = OracleProposer(ids + want, accept_rate, vocab, max_draft=6, seed=1)
    seen: list[int] = []

    class Flipping(AutoCap):
        def observe(self, k: int, accepted: int, seconds: float) -> None:
            seen.append(k)
            slow_verify = len(seen) < 30  # first parked, then drafting pays
            super().observe(k, accepted, 1.0 + (1.0 if slow_verify else 0.01) * k)

    monkeypatch.setattr(loop, "AutoCap", Flipping)
    auto = outrider.Pipeline(pipe.target, oracle, "oracle", 6, auto_cap=True)
    got = auto.generate(ids, max_tokens=60, stop_tokens=set())
    assert got.tokens == want
    assert 0 in seen and max(seen) > 1  # it parked and it drafted


def test_parked_steps_keep_the_drafter_and_the_prefix_cache_in_step(
    qwen3_target, drafters, monkeypatch
):
    """DSpark rounds resume after pipelined plain steps with the drafter's context complete
    (every plain token's taps were observed), the generation stops exactly at max_tokens, and
    the prefix cache stores what the cache holds: the repeat hits and is still plain greedy."""
    pipe = outrider.load(
        str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft="auto"
    )
    assert pipe.auto_cap
    pipe.enable_prefix_cache(gb=0.1)
    ids = pipe.encode(PROMPTS[0])
    want = plain_greedy(qwen3_target, ids, 45)
    kinds: list[int] = []

    class Alternating(AutoCap):
        def observe(self, k: int, accepted: int, seconds: float) -> None:
            kinds.append(k)
            slow_verify = (len(kinds) // 12) % 2 == 0  # park, draft, park, ...
            super().observe(k, accepted, 1.0 + (1.0 if slow_verify else 0.01) * k)

    monkeypatch.setattr(loop, "AutoCap", Alternating)
    first = pipe.generate(ids, max_tokens=45, stop_tokens=set())
    again = pipe.generate(ids, max_tokens=45, stop_tokens=set())
    assert first.tokens == want == again.tokens
    assert again.cached_tokens > 0
    assert 0 in kinds and max(kinds) > 0
    assert first.to_json()["max_draft"] == "auto"


def test_a_probe_drafts_the_cap_that_would_pay_and_unparks_when_it_does():
    """Cheap verify rows (a launch-bound GPU) but hard text: parked. The probe drafts the cap
    that would pay on easy text, and when the text turned easy, drafting resumes."""
    policy = trained(6, lambda k: 1.0 + 0.5 * k, 0.2)
    assert policy.choose(100) == 0
    policy.plain_run(100)
    probe = policy.choose(100)
    assert probe > 1
    for _ in range(4):  # the text got easy: every draft accepted
        policy.observe(probe, probe, 1.0 + 0.5 * probe)
    assert policy.choose(100) > 0 and policy.parked == 0
