"""`--max-draft auto`: the cap policy picks what measured costs and acceptance say is fastest,
parks speculation when plain decoding is faster, and never changes a token."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import loop, parked
from outrider.core.calibration import Calibration
from outrider.core.schedule import AutoCap


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
    failed probe (one plain step's time lost) costs 1.5% of the run: 66 steps."""
    caps, gaps = probe_gaps(trained(6, lambda k: 1.0 + 1.0 * k, 0.5))
    assert caps and set(caps) == {1}
    assert gaps[:3] == [32, 64, 66] and set(gaps[2:]) == {66}


def test_a_costly_probe_waits_longer():
    """A drafter call worth ten plain steps (a drafter on a CPU): runs double to the ceiling."""
    caps, gaps = probe_gaps(trained(6, lambda k: 1.0 + 10.0 * k, 0.05), steps=1200)
    assert set(caps) == {1}
    assert gaps[:4] == [32, 64, 128, 256] and set(gaps[3:]) == {256}


def test_a_small_cap_whose_drafts_are_all_kept_tries_a_wider_one():
    """Hard text (a chat) taught the policy that second drafts fail and left it at cap 1. The
    text turns easy: every round keeps its one draft. Rounds at cap 1 never reach position 2,
    so only optimism about the position past a cap taken whole widens the cap again; once
    wider rounds run, they teach the real acceptance there."""
    policy = trained(8, lambda k: 1.0 + 0.05 * k, 0.9)
    policy.accept = [0.9] + [0.05] * 7  # what the hard text left behind past the first draft
    assert policy.choose(100) == 1
    caps = []
    for _ in range(80):  # easy text: every draft is accepted
        k = policy.choose(100)
        caps.append(k)
        policy.observe(k, k, 1.0 + 0.05 * k)
    assert caps[0] == 1 and caps[-1] == 8 and caps == sorted(caps)


def test_optimism_past_the_cap_is_corrected_by_the_rounds_it_buys():
    """Rounds at cap 1 taken whole lift position 2; rounds at cap 2 that lose the second draft
    bring it back down four times as fast, so the policy stays mostly at cap 1 (it keeps
    trying cap 2 now and then: the price of noticing when the text turns easy)."""
    policy = trained(8, lambda k: 1.0 + 0.3 * k, 0.9)
    policy.accept = [0.95] + [0.05] * 7
    caps = []
    for _ in range(300):
        k = policy.choose(100)
        caps.append(k)
        policy.observe(k, min(k, 1), 1.0 + 0.3 * k)  # the first draft always kept, never the second
    assert 2 in caps  # it did try
    assert set(caps) == {1, 2} and caps[-100:].count(1) >= 70  # and learned that it rarely pays


def test_one_probe_on_text_that_turned_easy_unparks_the_drafter():
    """Hard text parked the drafter (acceptance 0.2 everywhere). The next probe keeps all its
    drafts but the last: a probe samples text the estimates have not seen for tens of steps, so it
    weighs more than a drafting round (PROBE_EMA), and drafting resumes at once instead of
    after several probes spaced ever further apart."""
    policy = trained(8, lambda k: 1.6 + 0.05 * k if k else 1.0, 0.2)
    assert policy.choose(100) == 0
    k = 0
    while not k:
        k = policy.choose(100)
        if not k:
            policy.plain_run(100)
    assert policy.probing and k >= 3
    policy.observe(k, k - 1, 1.6 + 0.05 * k)
    assert policy.choose(100) > 0


def test_an_intermediate_cost_picks_an_intermediate_cap():
    policy = trained(8, lambda k: 1.0 + 0.25 * k, 0.7)
    # E(k) / c(k) with s_j = 0.7^j: best at k = 2 (1.19 tokens per unit, vs 1.0 plain)
    assert policy.choose(100) == 2
    assert policy.choose(1) == 1  # never more than the tokens left


def test_unmeasured_caps_are_read_off_the_line_through_measured_drafting_caps():
    """Plain steps (pipelined, no drafter) are not on the drafting rounds' line."""
    policy = AutoCap(8)
    for _ in range(10):
        policy.observe(0, 0, 1.0)
        policy.observe(4, 2, 3.0)
    assert policy.cost(0) == pytest.approx(1.0)
    assert policy.cost(2) == policy.cost(8) == pytest.approx(3.0)  # one drafting cap measured
    for _ in range(10):
        policy.observe(2, 1, 2.0)
    assert policy.cost(3) == pytest.approx(2.5)
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


class PerStep(AutoCap):
    """AutoCap whose parked runs reach `observe` step by step (the loop hands a run's steps
    over at its end, `observe_plain`), so a test's own `observe` shapes plain steps too."""

    def observe_plain(self, seconds: list[float]) -> None:
        for s in seconds:
            self.observe(0, 0, s)


def test_a_copy_breaks_parked_plain_steps_only_where_it_pays():
    """A copy round costs what copy rounds have been timed at here (its verify until one is
    timed), plus one plain step for the broken pipeline; it must commit more than that many
    plain steps' worth of tokens. On a launch-bound GPU (the demo pair on an H100, where a
    copy round took 2.24 ms against a calibrated 4-row verify of 1.30) a short copy of chat
    text loses once copies are timed, and a long one of code pays."""
    gpu = Calibration({}, {128: [1.05, 1.06, 1.05, 1.30, 1.31, 1.36, 1.43, 1.58, 1.55]},
                      draft_ms=0.99, plain_ms={128: 0.80})  # fmt: skip
    policy = AutoCap(8, calibration=gpu)
    policy.context = 128
    assert policy.copy_pays(3, 1 + 0.6 * 3)  # untimed: 2.8 tokens for a 1.30 ms verify
    policy.observe_copy(3, 0.00224)
    assert policy.copy_scale == pytest.approx(2.24 / 1.30)
    assert not policy.copy_pays(3, 1 + 0.6 * 3)  # 2.8 tokens for 2.24 + 0.8 ms
    assert policy.copy_pays(16, 1 + 0.8 * 16)  # 13.8 tokens for ~3.5 ms
    assert AutoCap(8).copy_pays(3, 1.0)  # no calibration, no round timed: every copy is taken
    live = trained(8, lambda k: 1.0 + 0.3 * k, 0.5)  # no calibration: live rounds weigh it
    assert not live.copy_pays(3, 1 + 0.1 * 3)  # 1.3 tokens for a 1.9 s round and a step
    assert live.copy_pays(8, 1 + 8)  # 9 tokens for 3.4 s and a step


def test_a_measured_restart_of_the_plain_run_after_a_copy_counts_toward_its_cost():
    """A parked run's first plain step waits for a forward nothing queued ahead; what it costs
    beyond a steady step (`observe_restart`) is added to every copy's cost. Untimed it is 0
    (one plain step for the dropped forward, as before); a hiccup moves it a bounded step."""
    gpu = Calibration({}, {128: [1.05, 1.06, 1.05, 1.30, 1.31, 1.36, 1.43, 1.58, 1.55]},
                      draft_ms=0.99, plain_ms={128: 0.80})  # fmt: skip
    policy = AutoCap(8, calibration=gpu)
    policy.context = 128
    policy.observe_copy(4, 0.0016)  # copy rounds measured at 1.6 ms
    kept = 1 + 0.7 * 4  # 3.8 tokens for 1.6 + 0.8 ms: pays
    assert policy.restart == 0.0 and policy.copy_pays(4, kept)
    policy.observe_restart(0.0008 + 0.0006)  # the run after it waited 0.6 ms more
    assert policy.restart == pytest.approx(0.0006) and policy.restarts == 1
    assert not policy.copy_pays(4, kept)  # 3.8 tokens for 1.6 + 0.8 + 0.6 ms: 3.75 steps
    policy.observe_restart(0.0001)  # faster than a steady step: no excess
    assert policy.restart == pytest.approx(0.0006 * (1 - 0.25))
    policy.observe_restart(1.0)  # a hiccup: at most OUTLIER plain steps
    assert policy.restart <= 0.0006 + 0.25 * 2 * 0.0008
    assert policy.snapshot()["restart_ms"] == pytest.approx(policy.restart * 1e3, abs=1e-3)


def launch_bound(k: int) -> float:
    """A GPU's round: a drafter call and a sync cost 0.4 of a plain step, a verify row 0.03."""
    return 1.0 + (0.4 + 0.03 * k if k else 0.0)


def test_a_probe_drafts_the_cap_that_would_pay_and_unparks_when_it_does():
    """Cheap verify rows (a launch-bound GPU) but hard text: parked. The probe drafts the cap
    that would pay on easy text, and when the text turned easy, drafting resumes."""
    policy = trained(6, launch_bound, 0.2)
    assert policy.choose(100) == 0
    policy.plain_run(100)
    probe = policy.choose(100)
    assert probe == 6
    for _ in range(4):  # the text got easy: every draft accepted
        policy.observe(probe, probe, launch_bound(probe))
    assert policy.choose(100) > 0 and policy.parked == 0


def test_a_probe_widens_as_the_parked_run_grows_where_verify_rows_cost():
    """A drafting round costs 0.3 of a plain step plus 0.3 a draft (a CPU): the full cap would
    pay on easy text, but each draft past a probe's first loses 0.3 of a step when nothing is
    accepted. Each probe drafts what 1.5% of the plain steps before it affords: one draft after
    the first 16 steps, then wider as the intervals grow (each as long as the probe before it
    needs for its whole loss to be 1.5%), up to the cap."""
    cpu = lambda k: 1.0 + (0.3 + 0.3 * k if k else 0.0)  # noqa: E731
    policy = trained(6, cpu, 0.2)
    assert policy.best(100, 0.9) == 6
    caps, gaps = probe_gaps(policy, 600)
    assert caps[0] == 1 and caps == sorted(caps) and len(set(caps)) > 3 and caps[-1] == 6
    for k, steps in zip(caps, [16, *gaps]):  # a probe's drafts past its first fit the budget
        assert cpu(k) - cpu(1) <= 0.015 * (steps + 1) + 1e-9, (caps, gaps)


# -- acceptance learnt while parked, from a host drafter's unverified drafts --------------------


def test_parked_lookup_learns_acceptance_from_the_tokens_that_follow():
    """While parked, each plain token is checked against what lookup would have drafted: text
    that copies earlier context raises the acceptance estimate (and unparks) with no probe, and
    text that does not lowers it."""
    from outrider.core.sampling import SamplingParams
    from outrider.core.stopping import Stopper
    from outrider.plugins.strategies.lookup import LookupProposer

    def parked_row(history):
        policy = trained(8, lambda k: 1.0 + 0.3 * k, 0.1)
        assert policy.choose(100) == 0
        row = loop.Row(
            LookupProposer(max_draft=8), Stopper(100, set()), SamplingParams(), None,
            list(history), history[-1], 8, policy=policy,
        )  # fmt: skip
        return row, policy

    earlier = list(range(100, 140))
    row, policy = parked_row([*earlier, 7, 100])
    shadow = parked.Shadow(row)
    for token in earlier[1:]:  # the text repeats what came before, token for token
        shadow.check(token)
        row.history.append(token)
    assert policy.accept[0] > 0.5 and policy.accept[5] > 0.4  # from 0.1, in five drafts
    assert policy.choose(100) > 0  # unparked without a probe

    # it asks for host ids only (`propose_host`), never for a round's device array
    row, policy = parked_row([*earlier, 7, 100])
    row.proposer.propose = None  # a call would raise
    shadow = parked.Shadow(row)
    shadow.check(earlier[1])
    assert shadow.draft == earlier[1:9] and shadow.matched == 1

    row, policy = parked_row([*earlier, 7, 100])
    shadow = parked.Shadow(row)
    before = list(policy.accept)
    for token in range(500, 530):  # new text: the copy lookup drafts is wrong at once
        shadow.check(token)
        row.history.append(token)
    assert policy.accept[0] < before[0]


def test_auto_lookup_output_equals_plain_greedy_and_learns_while_parked(qwen3_target, monkeypatch):
    pipe = outrider.load(str(qwen3_target), mode="lookup", max_draft="auto")
    ids = pipe.encode(PROMPTS[2])
    want = plain_greedy(qwen3_target, ids, 60)
    learnt: list[int] = []

    class Slow(PerStep):  # verify rows cost as much as plain steps: parked after learning
        def observe(self, k: int, accepted: int, seconds: float) -> None:
            super().observe(k, accepted, 1.0 + k)

        def observe_unverified(self, k: int, accepted: int) -> None:
            learnt.append(k)
            super().observe_unverified(k, accepted)

    monkeypatch.setattr(loop, "AutoCap", Slow)
    auto = outrider.Pipeline(pipe.target, pipe.proposer, "lookup", 16, auto_cap=True)
    got = auto.generate(ids, max_tokens=60, stop_tokens=set())
    assert got.tokens == want
    assert learnt  # parked plain steps checked lookup's drafts


def calibrated(plain_ms: float, per_row_ms: float, draft_ms: float) -> AutoCap:
    """A fresh policy with a calibration: a forward of w rows costs plain_ms + per_row_ms (w-1)."""
    from outrider.core.calibration import Calibration

    curve = [plain_ms + per_row_ms * w for w in range(9)]
    return AutoCap(8, calibration=Calibration({}, {128: curve}, draft_ms=draft_ms))


def test_a_machine_where_no_cap_can_pay_never_drafts():
    # a CPU-like machine: every verified row costs about a plain step, a drafter call three
    policy = calibrated(10.0, 9.0, 30.0)
    plan = []
    while len(plan) < 400:
        k = policy.choose(100)
        plan += [k] if k else [0] * policy.plain_run(100)
    assert plan == [0] * len(plan), "it drafted (learning or probing) where nothing can pay"


def test_a_machine_where_only_easy_text_pays_probes_but_skips_the_learning_rounds():
    # drafts pay only if nearly all are accepted: no learning rounds, but probes
    policy = calibrated(10.0, 1.0, 60.0)
    assert policy.best(8, 1.0) and not policy.best(8, 0.9)
    probes, gaps = probe_gaps(policy, 400)
    assert probes and gaps and min(gaps) >= policy.probe_every


def test_a_machine_where_drafting_pays_learns_at_the_start_cap():
    policy = calibrated(10.0, 0.5, 2.0)  # a GPU-like curve
    assert [policy.choose(100) for _ in range(3)] == [4, 4, 4]


def test_where_no_cap_can_pay_auto_decodes_plainly(qwen3_target, drafters):
    """With a calibration that says no cap pays even at full acceptance, a generation is plain
    decoding outright: no drafting round, no taps for the drafter, plain greedy's tokens."""
    from outrider.core.calibration import Calibration

    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    pipe.calibration = Calibration({}, {128: [10.0 + 9.0 * w for w in range(9)]}, draft_ms=30.0)
    pipe.auto_cap, pipe.cap_policy = True, None
    observed: list[int] = []
    observe = pipe.proposer.observe
    pipe.proposer.observe = lambda n, taps: (observed.append(n), observe(n, taps))[1]
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=30, max_draft="auto", stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 30)
    assert not any(r.drafted for r in got.rounds) and not observed


def test_one_slow_round_does_not_park_a_drafter_that_pays():
    """A timed round that paid a kernel compile (1000x its calibrated cost, seen on the H200
    when a new verify width first runs) moves the cost estimate one bounded step: the policy
    keeps drafting, and nothing it measured live can make it call the machine hopeless."""
    policy = calibrated(10.0, 0.5, 2.0)  # a GPU-like curve
    ms = lambda k: policy.calibration.round_cost(k, 128)  # noqa: E731
    for _ in range(policy.warmup):
        policy.observe(4, 4, ms(4))
    policy.observe(4, 4, 1000 * ms(4))  # the compile
    for _ in range(6):
        policy.observe(4, 4, ms(4))
    assert policy.scale[True] < 2.0  # at most OUTLIER off, then decaying back
    assert not policy.hopeless(8)
    assert policy.choose(100) > 0


def test_a_cap_that_ran_slow_for_a_while_is_not_left_at_that_cost():
    """Drafting rounds of every cap share one live scale over the calibrated curve. With a
    scale per cap, a cap whose rounds once ran slow (a busy minute, a compile) kept that cost,
    lost to a smaller cap, and was never timed again (on the H200, cap 7 read 3x its curve
    while cap 4 read 1.9x); here the rounds that follow at the curve's cost bring it back."""
    policy = calibrated(10.0, 0.5, 2.0)  # a GPU-like curve
    policy.accept = [0.9] * 8
    ms = lambda k: policy.calibration.round_cost(k, 128)  # noqa: E731
    for _ in range(policy.warmup + 4):
        policy.observe(4, 4, ms(4))
    for _ in range(policy.warmup + 6):  # a slow minute while it drafted the full cap
        policy.observe(8, 8, 4 * ms(8))
    assert policy.cost(8) > 2 * ms(8)  # the slow rounds count
    for _ in range(30):  # then every round costs what the curve says
        k = policy.choose(100)
        policy.observe(k, k, ms(k))
    assert policy.choose(100) == 8


def test_live_rounds_slower_than_the_curve_park_but_keep_probing():
    """Rounds that really are far slower than calibrated (say, a busy host) park the drafter
    through the live costs, yet the machine is not hopeless: probes keep asking."""
    policy = calibrated(10.0, 0.5, 2.0)
    policy.accept = [0.9] * 8
    for _ in range(40):  # every drafting round 20x its calibrated cost
        policy.observe(4, 1, 20 * policy.calibration.round_cost(4, 128))
    assert policy.scale[True] > 10  # the estimate got there, a bounded step at a time
    assert not policy.hopeless(8)
    caps, gaps = probe_gaps(policy, 400)
    assert caps and gaps  # parked, but probing


def test_a_probe_taken_whole_brings_the_next_probe_sooner_and_a_failed_one_later():
    """Parked on hard text: a probe whose drafts are all kept resets the interval (the text may
    have turned easy; one probe moves the acceptance estimate only a little), a failed one
    doubles it."""
    for accepted, want in (("all", 16), ("none", 32)):
        policy = trained(6, lambda k: 1.0 + 0.5 * k, 0.2)
        assert policy.choose(100) == 0
        policy.plain_run(100)
        probe = policy.choose(100)
        assert probe > 0 and policy.interval == 32
        policy.observe(probe, probe if accepted == "all" else 0, 1.0 + 0.5 * probe)
        assert policy.choose(100) == 0, "one probe does not unpark"
        assert policy.interval == want, accepted


def test_a_new_generation_probes_after_the_first_interval_again_when_parked():
    """A pipeline's policy parked by one text probes the next text after `probe_every` plain
    steps (past its opening, the hardest part to draft), instead of waiting out the interval
    the last text's failed probes grew, once the plain steps since have paid for a probe
    (the probe bank, next test)."""
    policy = trained(6, lambda k: 1.0 + (1.0 + 0.03 * k if k else 0.0), 0.2)
    for _ in range(3):  # failed probes: the interval grows
        policy.plain_run(1000)
        policy.observe(policy.choose(100), 0, 3.0)
    assert policy.interval > 64
    while policy.probe_due():  # the last text's plain steps pay for the next probe
        policy.plain_run(1000)
    policy.new_generation()
    assert policy.choose(100) == 0 and policy.plain_run(1000) == 16
    assert policy.choose(100) > 0
    drafting = trained(6, lambda k: 1.0 + 0.02 * k, 0.9)
    drafting.new_generation()
    assert drafting.choose(100) == 6, "a policy that drafts goes on drafting"


def test_time_outside_the_loop_counts_toward_plain_steps_and_rounds_alike():
    """Inside the loop a round costs 2.2 plain steps and commits 1.94 tokens: parked. A caller
    that keeps every step as long again as a plain step (detokenising, streaming) pays that per
    token when parked but once per round when drafting: then drafting is faster, and the
    policy, told the caller's time, drafts."""
    policy = trained(4, lambda k: 1.0 if k == 0 else 2.2, 0.5)
    assert policy.choose(100) == 0
    for _ in range(10):
        policy.observe_outside(1.0)
    assert policy.outside == pytest.approx(1.0)
    assert policy.choose(100) == 4
    policy.observe_outside(100.0)  # one stall of the caller moves the estimate a bounded step
    assert policy.outside == pytest.approx(1.25)


def test_auto_tells_its_policy_how_long_the_caller_kept_each_step(qwen3_target, drafters):
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    steps = 0
    for _ in pipe.stream(PROMPTS[1], max_tokens=24, max_draft="auto"):
        steps += 1
    assert steps > 1
    assert pipe.cap_policy is not None and pipe.cap_policy.outside > 0


@pytest.mark.parametrize("with_calibration", [False, True])
def test_a_parked_run_told_at_its_end_leaves_the_policy_as_step_by_step_would(with_calibration):
    """`observe_plain` (what the loop calls when a parked run ends) moves the plain-step cost
    and the counts exactly as `observe(0, 0, s)` for each step would, warm-up steps included."""

    def fresh() -> AutoCap:
        if with_calibration:
            return calibrated(plain_ms=2.0, per_row_ms=0.5, draft_ms=1.0)
        return AutoCap(8)

    seconds = [0.004, 0.0021, 0.0019, 0.05, 0.002, 0.0022, 0.0018]  # a hiccup among them
    one_by_one, at_end = fresh(), fresh()
    for policy in (one_by_one, at_end):
        policy.context = 300
        policy.observe(3, 2, 0.01)  # a drafting round before the run
    for s in seconds:
        one_by_one.observe(0, 0, s)
    at_end.observe_plain(seconds)
    assert at_end.rounds == one_by_one.rounds
    assert at_end.costs == one_by_one.costs and at_end.scale == one_by_one.scale
    assert at_end.cost(0) == one_by_one.cost(0)
    assert at_end.accept == one_by_one.accept and at_end.drafting == one_by_one.drafting
    assert (at_end.scale if with_calibration else at_end.costs) != fresh().costs  # it moved


def test_a_burst_of_slow_plain_steps_does_not_make_plain_decoding_look_dear():
    """A plain step costs the median of the latest ones. A burst of slow steps at the end of
    a parked run (a host hiccup: on an H100, four steps at 1.5-4.7x) must not make plain
    decoding look dear: a policy that believes it dear drafts where drafting does not pay, and
    then never times a plain step again to learn otherwise (the demo pair's DFlash on chat
    drafted at 1.8x the true plain cost for the rest of a benchmark)."""
    policy = calibrated(1.0, 0.1, 0.8)  # an H100-like curve for the demo pair
    policy.context = 128
    plain = policy._curve(0)
    policy.accept = [0.4] * 8  # chat: drafting at this acceptance loses to plain steps
    assert policy.best(8) == 0
    policy.observe_plain([plain] * 28 + [r * plain for r in (1.45, 2.73, 4.69, 3.17)])
    assert policy.cost(0) < 1.1 * plain
    assert policy.best(8) == 0  # still parked


def test_failed_probes_lose_at_most_the_probe_budget_of_the_parked_steps():
    """Short answers, each a new generation, on text where drafting does not pay: the interval
    restarts at `probe_every` every answer, and a probe loses more than its round's verify (a
    model drafter first takes in every token it missed while parked; on the 2-core CPU that
    left DSpark at 0.94x of plain decoding). Each parked step pays PROBE_BUDGET of its cost
    into a bank and each probe takes out what it lost, so over many answers the probes lose
    at most PROBE_BUDGET of the plain steps (plus what the bank held at the start)."""
    from outrider.core.schedule import BANKED_PROBES, PROBE_BUDGET

    policy = trained(6, lambda k: 1.0 + (1.0 + 0.03 * k if k else 0.0), 0.2)
    catch_up = 4.0  # the drafter taking in what it missed: four plain steps' worth
    steps = lost = 0.0
    probes = 0
    for _ in range(40):  # answers of 100 tokens
        policy.new_generation()
        made = 0
        while made < 100:
            k = policy.choose(100 - made)
            if not k:
                n = policy.plain_run(100 - made)
                steps, made = steps + n, made + n
                continue
            seconds = 1.0 + (1.0 + 0.03 * k) + catch_up
            policy.observe(k, 0, seconds)  # nothing accepted: one token for the round
            lost, made, probes = lost + seconds - 1.0, made + 1, probes + 1
    worst = 1.0 + 0.03 * 6 + catch_up  # a probe at the full cap, over its one plain step
    assert probes >= 3, "it still probes"
    assert lost <= PROBE_BUDGET * steps + BANKED_PROBES * worst, (lost, steps, probes)
    assert 1.0 + catch_up <= policy.probe_loss <= worst  # measured, catch-up and all


def test_the_probe_bank_counts_what_was_paid_in_and_what_a_probe_lost():
    """Steps a plain run granted and did not take (an answer that ended, a copy that broke the
    run) take back what they paid in, not what the bank's cap kept out; a probe's loss counts
    the time the caller kept it (`outside`, which each plain step it replaced also pays); and
    one probe that paid a kernel compile counts as a bounded loss."""
    policy = trained(6, lambda k: 1.0 + (1.0 + 0.03 * k if k else 0.0), 0.2)
    policy.outside = 0.5  # a plain step: 1.0 in the loop + 0.5 outside
    policy.plain_run(100)
    policy.observe(policy.choose(100), 0, 3.0)  # a failed probe: one token for 3.0 + 0.5
    assert policy.probe_loss == pytest.approx(3.0 + 0.5 - 1.5)
    from outrider.core.schedule import BANKED_PROBES

    while policy.bank < BANKED_PROBES * policy.probe_loss:  # refill the bank to its cap
        policy.plain_run(1000)
    full = policy.bank
    policy.new_generation()
    n = policy.plain_run(1000)  # at the cap: nothing more goes in
    assert n == policy.probe_every
    policy.plain_unused(n - 1)  # the answer ended after one step
    assert policy.bank == pytest.approx(full) and policy.probe_due() == 0
    while not policy.choose(100):  # the next probe paid a compile: 200 plain steps' time
        policy.plain_run(1000)
    policy.observe(1, 0, 200.0)
    assert policy.probe_loss < 5 * 2.0, "one compile moves the estimate a bounded step"


def test_a_probe_that_never_ran_is_not_charged_to_the_next_round():
    """A probe was chosen, but its round ran without the policy being told (a lookup copy took
    it, the drafter made no drafts, a reasoning budget closed it): the next drafting round is
    an ordinary one, not a probe that lost or paid."""
    policy = trained(6, lambda k: 1.0 + 0.5 * k, 0.2)
    policy.plain_run(100)
    assert policy.choose(100) > 0 and policy.probing
    policy.untold()
    policy.observe(4, 4, 3.0)
    assert policy.probe_loss is None and policy.bank is None
