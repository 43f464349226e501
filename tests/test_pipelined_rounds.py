"""Pipelined rounds (core/loop.py `decode`): the next round is queued on the guess that this
one keeps every draft, and dropped unread when it does not. Output must stay plain greedy."""

from __future__ import annotations

import random
import statistics

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import ahead_gate
from outrider.core.ahead_gate import PRIOR_NEED, AheadGate
from outrider.core.device import PIPELINE_ENV
from outrider.core.errors import OutriderError
from outrider.core.loop import decode
from outrider.core.proposer import DraftContext, Proposal
from outrider.core.sampling import SamplingParams
from outrider.core.stopping import Stopper
from outrider.plugins.strategies.lookup import LookupProposer
from outrider.plugins.strategies.lookup_assist import LookupAssist
from outrider.testing import OracleProposer, make_tiny_drafter

GREEDY = SamplingParams()
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a"


@pytest.fixture(autouse=True)
def pipelined_everywhere(monkeypatch):
    """Queue every round that can go ahead: `auto` never pipelines on a CPU."""
    monkeypatch.setenv(PIPELINE_ENV, "on")


@pytest.fixture(scope="module")
def target(qwen3_target):
    return outrider.load(str(qwen3_target), mode="baseline").target


def run(target, proposer, ids, n, cap, pipelined, stop_tokens=frozenset()):
    pipe = outrider.pipeline_from_parts(target, proposer, proposer.name, max_draft=cap)
    pipe.pipelined_rounds = pipelined
    return pipe.generate(ids, max_tokens=n, stop_tokens=set(stop_tokens))


@pytest.mark.parametrize("rate", [0.3, 0.8, 1.0])
@pytest.mark.parametrize("cap", [1, 3, 6])
def test_oracle_rounds_pipelined_equal_plain_greedy(target, qwen3_target, rate, cap):
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 60)
    oracle = OracleProposer(ids + want, rate, vocab_size=262, max_draft=cap, seed=3)
    got = run(target, oracle, ids, 60, cap, pipelined=True)
    assert got.tokens == want
    ahead, dropped = got.pipelining
    if rate == 1.0:  # every round after the first was queued ahead and kept
        assert ahead == len(got.rounds) - 1 and dropped == 0
    elif rate == 0.8:
        assert ahead > 0
        if cap == 1:  # guesses right and wrong both come up
            assert dropped > 0
    off = run(target, OracleProposer(ids + want, rate, 262, cap, seed=3), ids, 60, cap, False)
    assert off.tokens == want and off.pipelining == (0, 0)


def test_lookup_rounds_pipelined_equal_plain_greedy(target, qwen3_target):
    ids = target.tokenizer.encode(PROMPT * 3)
    want = plain_greedy(qwen3_target, ids, 80)
    got = run(target, LookupProposer(max_draft=6), ids, 80, 6, pipelined=True)
    assert got.tokens == want
    assert got.pipelining[0] > 0  # the tiny target repeats itself: some guesses held


def test_sampled_rounds_are_not_pipelined(target):
    ids = target.tokenizer.encode("The quick brown fox")
    pipe = outrider.pipeline_from_parts(target, LookupProposer(max_draft=4), "lookup", 4)
    got = pipe.generate(ids, max_tokens=40, temperature=0.8, seed=1, stop_tokens=set())
    assert got.pipelining == (0, 0)


def cache_capture(target, monkeypatch) -> list:
    made = []
    fresh = target.make_cache

    def make_cache():
        made.append(fresh())
        return made[-1]

    monkeypatch.setattr(target, "make_cache", make_cache)
    return made


def committed_positions(prompt: list[int], steps) -> int:
    """What the cache must hold after these steps: the prompt and every committed token but
    the last (the anchor the target has not seen)."""
    n = len(prompt)
    for step in steps:
        n += 1 if step.source == "prefill" else step.accepted + 1
    return n - 1


def test_a_round_in_flight_is_dropped_when_the_answer_stops(target, qwen3_target, monkeypatch):
    """A stop token ends the answer while a round queued behind it already ran: the cache
    must end holding what was committed, not the dropped round's positions."""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 40)
    made = cache_capture(target, monkeypatch)
    oracle = OracleProposer(ids + want, 1.0, vocab_size=262, max_draft=4)
    stopper = Stopper(40, {want[17]})
    steps = list(decode(target, oracle, ids, stopper, max_draft=4))
    assert stopper.finish_reason == "stop"
    assert any(s.dropped for s in steps)
    assert made[0][0].offset == committed_positions(ids, steps)


def test_closing_the_generation_drops_the_round_in_flight(target, qwen3_target, monkeypatch):
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 40)
    made = cache_capture(target, monkeypatch)
    oracle = OracleProposer(ids + want, 1.0, vocab_size=262, max_draft=3)
    gen = decode(target, oracle, ids, Stopper(40, set()), max_draft=3)
    steps = [next(gen) for _ in range(4)]  # the prefill and three rounds, one more queued
    gen.close()
    assert all(c.offset == committed_positions(ids, steps) for c in made[0])


def test_auto_queues_rounds_whose_guesses_hold(target, qwen3_target, monkeypatch):
    """With the gate on its own timings, an oracle that is always right soon queues every
    round where the device is not the host's own cores: its hold rate passes whatever
    1 - H / D this machine measures. (On the CPU's rule a round whose launch computes all of
    it hides nothing, so there it need not: the rule's own test is above.)"""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 100)
    monkeypatch.setenv(PIPELINE_ENV, "auto")
    monkeypatch.setattr(ahead_gate, "computes_on_host", lambda: False)
    oracle = OracleProposer(ids + want, 1.0, vocab_size=262, max_draft=2)
    got = run(target, oracle, ids, 100, 2, pipelined=True)
    assert got.tokens == want
    assert got.pipelining[0] > 0 and got.pipelining[1] == 0
    assert all(r.ahead for r in got.rounds[-10:])
    monkeypatch.setenv(PIPELINE_ENV, "sometimes")
    with pytest.raises(OutriderError, match=PIPELINE_ENV):
        run(target, OracleProposer(ids, 1.0, 262, 4), ids, 8, 4, pipelined=True)


class FixedCosts(AheadGate):
    """A gate whose round costs are given (H seconds to launch, R a round alone), not timed:
    the model's costs stand."""

    def __init__(self, host: float, round_: float) -> None:
        super().__init__()
        self.host, self.round = host, round_

    def timed_launch(self, seconds: float) -> None:
        pass

    def timed_round(self, seconds: float) -> None:
        pass

    def timed(self, kind: str, seconds: float) -> None:
        pass


def test_the_gate_weighs_a_kept_round_against_a_dropped_one():
    gpu = FixedCosts(0.3, 1.0)  # the host's work is a good part of a round
    assert gpu.need == pytest.approx(1 - 0.3 / 0.7)
    assert not gpu.wanted()  # a guess as likely to fail as to hold does not pay here
    gpu.learn(True)
    assert gpu.wanted()
    gpu.learn(False)
    gpu.learn(None)  # a round with nothing to guess says nothing
    assert not gpu.wanted()
    cpu = FixedCosts(0.05, 1.0)  # the forward dwarfs the host's work
    rounds = 0
    while not cpu.wanted():
        cpu.learn(True)
        rounds += 1
    assert cpu.need > 0.94 and rounds >= 8
    assert FixedCosts(0.6, 1.0).need == 0.0  # the host is the bottleneck: always queue
    assert AheadGate(always=True).wanted()
    fresh = AheadGate()
    assert fresh.need == PRIOR_NEED
    fresh.timed_launch(0.2)
    fresh.timed_round(1.0)
    assert fresh.need == pytest.approx(0.75)
    # the CPU: launching computes most of a round, and a dropped round costs a whole one
    cpu = FixedCosts(0.8, 1.0)
    assert cpu.need == 0.0  # a GPU's rule: the host is the bottleneck, always queue
    cpu.shared = True
    assert cpu.need == pytest.approx(1.0 / 1.2)  # R / (R + D): hides 0.2, risks 1.0
    cpu.learn(True)
    assert not cpu.wanted()  # a hold rate of 0.625 does not pay there


def test_timed_rounds_replace_the_gates_model():
    """What rounds are timed to cost replaces the model's guess: on the GPU's model a host
    that is 0.4 of a round asks a hold rate of a third, but rounds after a dropped one timed
    at twice a round alone (as on an H100 with the demo pair) ask far more, and rounds that
    hold no faster than alone never pay. A new generation forgets the hold rate, not the
    costs."""
    gate = AheadGate()
    gate.timed_launch(0.4)
    gate.timed_round(1.0)
    assert gate.costs() == pytest.approx((1.0, 0.6, 1.2))
    assert gate.need == pytest.approx(1 / 3)
    gate.timed("alone", 1.0)
    gate.timed("held", 0.8)
    gate.timed("dropped", 2.1)
    assert gate.need == pytest.approx(1.1 / 1.3)
    gate.hold = 0.8
    assert not gate.wanted()
    gate.timed("dropped", 100.0)  # a compile: one slow round moves it a bounded step
    assert gate.took["dropped"] < 4.2
    gate.timed("held", 1.2)
    gate.timed("held", 1.2)
    gate.timed("held", 1.2)
    assert gate.took["held"] > 1.0 and gate.need == 1.0
    gate.hold = 1.0
    assert not gate.wanted()  # not even an oracle's guesses pay
    assert AheadGate(always=True).wanted()
    gate.new_generation()
    assert gate.hold == 0.5 and gate.took["held"] > 1.0
    cpu = AheadGate(shared=True)  # every kind timed: no model needed
    for kind, seconds in zip(("alone", "held", "dropped"), (1.0, 0.5, 1.5)):
        cpu.timed(kind, seconds)
    assert cpu.need == pytest.approx(0.5)


class WrongGuesses(OracleProposer):
    """Drafts right, but guesses the token after its drafts wrong `miss` of the time."""

    def __init__(self, reference, miss: float, cap: int) -> None:
        super().__init__(reference, 1.0, 262, cap)
        self.miss, self._draws = miss, random.Random(9)

    def propose_ahead(self, ctx):
        guesses = super().propose_ahead(ctx).host
        if guesses and self._draws.random() < self.miss:
            guesses[0] = (guesses[0] + 1) % 262
        return Proposal.from_list(guesses)


def gated(monkeypatch, host: float, round_: float) -> None:
    """Generations get a gate with these round costs instead of timing their own."""
    monkeypatch.setattr(AheadGate, "for_this_device", lambda kept=None: FixedCosts(host, round_))


def test_rounds_that_would_not_hold_stop_the_queueing(target, qwen3_target, monkeypatch):
    """Under the gate, a proposer whose guesses fail four times in five soon stops queueing
    rounds (each dropped one cost a forward) and tries again after a hit; one whose guesses
    hold keeps queueing."""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 90)
    gated(monkeypatch, 0.4, 1.0)  # queueing pays above a hold rate of 1/3
    bad = run(target, WrongGuesses(ids + want, 0.8, 2), ids, 90, 2, True)
    assert bad.tokens == want
    dropped = sum(r.dropped > 0 for r in bad.rounds)
    assert 0 < dropped <= len(bad.rounds) // 2  # ungated: four rounds in five
    gated(monkeypatch, 0.6, 1.0)  # the host is the bottleneck: queueing always pays
    good = run(target, WrongGuesses(ids + want, 0.0, 2), ids, 90, 2, True)
    assert good.tokens == want and good.pipelining == (len(good.rounds) - 1, 0)


def drafter_blocks(result) -> set[tuple]:
    """(position, drafts) of each round the drafter drafted (a copy runs past its cap of 4)."""
    out, at = set(), len(result.prompt_tokens) + 1
    for r in result.rounds:
        if 0 < len(r.drafted) <= 4:
            out.add((at, tuple(r.drafted)))
        at += r.accepted + 1
    return out


def test_lookup_copies_inside_drafter_rounds_go_ahead(qwen3_target, drafters):
    """A DSpark round that verifies a lookup copy (lookup_assist.py) queues the copy's next
    stretch behind it, and a drafter round the drafter's next block. The drafter still takes
    in every verified token: the output stays plain greedy, and its own rounds accept what
    they accepted unpipelined."""
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    assert isinstance(pipe.proposer, LookupAssist)
    ids = pipe.encode(PROMPTS[2] + " " + PROMPTS[2])
    want = plain_greedy(qwen3_target, ids, 80)
    pipe.pipelined_rounds = False
    off = pipe.generate(ids, max_tokens=80, stop_tokens=set())
    pipe.pipelined_rounds = True
    got = pipe.generate(ids, max_tokens=80, stop_tokens=set())
    assert off.tokens == got.tokens == want
    assert got.pipelining[0] > 0 and off.pipelining == (0, 0)
    # the drafter's state followed every token: where both runs let it draft at the same
    # position, it drafted the same tokens
    common = drafter_blocks(off) & drafter_blocks(got)
    assert len(common) >= 10


@pytest.mark.parametrize("mode", ["dspark", "dflash", "dflash2", "eagle3"])
def test_drafter_blocks_drafted_ahead_change_no_round(qwen3_target, drafters, mode, tmp_path):
    """A DSpark, DFlash, DFlash 2 or EAGLE-3 round queues the drafter's next drafts behind it,
    made from the round's hidden states and the target's token after its drafts before either is
    read back. The drafter takes those rows in and drops them again when the round did not
    keep every draft, so every round drafts, accepts and commits what it does unpipelined
    (lookup copies off, so the rounds line up one for one), and the output is plain greedy."""
    drafter = tiny_head(mode, qwen3_target, drafters, tmp_path)
    pipe = outrider.load(str(qwen3_target), str(drafter), mode=mode, lookup_drafts=False)
    ids = pipe.encode(PROMPTS[2])
    want = plain_greedy(qwen3_target, ids, 40)
    for cap in (1, 3):
        pipe.pipelined_rounds = False
        off = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
        pipe.pipelined_rounds = True
        got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
        assert off.tokens == got.tokens == want
        assert [(r.drafted, r.accepted) for r in got.rounds] == [
            (r.drafted, r.accepted) for r in off.rounds
        ]
        ahead, dropped = got.pipelining
        assert dropped > 0  # blocks drafted on rows the round then rejected
        if cap == 1 and mode in ("dspark", "dflash"):  # and kept (the random DFlash 2 and
            assert ahead > 0  # EAGLE-3 heads accept little: their kept ones are the next test's)


def tiny_head(mode, qwen3_target, drafters, tmp_path):
    if mode in ("dflash2", "eagle3"):
        packaging = {"dflash2": "zlab", "eagle3": "deepspec"}[mode]
        return make_tiny_drafter(tmp_path / "d", qwen3_target, mode, packaging)
    return drafters["dspark" if mode == "dspark" else "dflash-deepspec"]


@pytest.mark.parametrize("mode", ["dspark", "dflash", "dflash2", "eagle3"])
@pytest.mark.parametrize("kept", [3, 1])
def test_a_block_drafted_ahead_is_the_block_drafted_after(qwen3_target, drafters, tmp_path, mode,
                                                          kept):  # fmt: skip
    """Proposer by proposer: drafts made ahead of a round that then keeps all 3 of its drafts
    are the drafts made once that round is observed, and the drafter goes on as if
    unpipelined; where the round keeps 1, the next drafts are the unpipelined ones too."""
    drafter = tiny_head(mode, qwen3_target, drafters, tmp_path)
    plain, ahead = (
        outrider.load(str(qwen3_target), str(drafter), mode=mode, lookup_drafts=False).proposer
        for _ in range(2)
    )
    width = len(plain.tap_layer_ids) * plain.spec.hidden_size
    taps = [mx.random.normal((n, width), key=mx.random.key(i)) for i, n in enumerate((9, 4, 2))]
    prompt = list(range(3, 12))
    history = prompt + [20]  # the prefill's token
    for p in (plain, ahead):
        p.start(prompt, taps[0])
    first = plain.propose(DraftContext(history, 3, GREEDY)).tokens.tolist()
    assert ahead.propose(DraftContext(history, 3, GREEDY)).tokens.tolist() == first
    drafted = ahead.draft_ahead(
        DraftContext(history, 3, GREEDY), mx.array(40, dtype=mx.uint32), taps[1]
    )
    for p in (plain, ahead):
        p.observe(kept, taps[1][: kept + 1])
    history += first[:kept] + [40]  # the drafts kept, then the target's token after them
    want = plain.propose(DraftContext(history, 3, GREEDY)).tokens.tolist()
    if kept == 3:
        assert drafted.tokens.tolist() == want
    else:
        assert ahead.propose(DraftContext(history, 3, GREEDY)).tokens.tolist() == want
    for p in (plain, ahead):  # and the round after that, which keeps 1
        p.observe(1, taps[2])
    history += [want[0], 41]
    again = DraftContext(history, 3, GREEDY)
    assert plain.propose(again).tokens.tolist() == ahead.propose(again).tokens.tolist()


def test_a_confidence_cut_drafts_nothing_ahead(qwen3_target, drafters):
    """A confidence threshold reads the block's confidences back before the round's forward,
    which would wait for the round in flight: such rounds are not queued ahead."""
    pipe = outrider.load(
        str(qwen3_target), str(drafters["dspark"]), mode="dspark", lookup_drafts=False,
        confidence_threshold=0.3,
    )  # fmt: skip
    ids = pipe.encode(PROMPTS[2])
    got = pipe.generate(ids, max_tokens=30, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 30)
    assert got.pipelining == (0, 0)


def test_a_pipeline_keeps_what_its_gate_timed(target, qwen3_target, monkeypatch):
    """Rounds are timed by how they began (after a held round, after a dropped one), into
    the pipeline's one gate, which the next generation reads: it does not learn each
    answer's costs again. The tokens stay plain greedy."""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 40)
    monkeypatch.setenv(PIPELINE_ENV, "on")  # queue every round: both outcomes come up
    proposer = WrongGuesses(ids + want, 0.5, 2)
    pipe = outrider.pipeline_from_parts(target, proposer, proposer.name, max_draft=2)
    first = pipe.generate(ids, max_tokens=40, stop_tokens=set())
    gate = pipe.ahead_gate
    assert first.tokens == want and first.pipelining[0] > 0 and first.pipelining[1] > 0
    assert set(gate.took) == {"held", "dropped"} and gate.always
    timed = dict(gate.took)
    second = pipe.generate(ids, max_tokens=40, stop_tokens=set())
    assert second.tokens == want and pipe.ahead_gate is gate and gate.took != timed


def test_guesses_that_hold_are_queued_again_now_and_then():
    """Where guesses nearly always hold but held rounds were timed no cheaper than rounds
    alone, the gate does not queue, except one round in RECHECK_EVERY, so that one slow
    reading of `held` is read again; where guesses fail, it never rechecks."""
    gate = AheadGate()
    for kind, seconds in (("alone", 1.0), ("held", 1.05), ("dropped", 2.0)):
        gate.timed(kind, seconds)
    gate.hold = 0.95
    queued = [gate.wanted() for _ in range(3 * ahead_gate.RECHECK_EVERY + 3)]
    assert sum(queued) == 3 and not queued[0] and queued[ahead_gate.RECHECK_EVERY]
    gate.hold = 0.5
    assert not any(gate.wanted() for _ in range(3 * ahead_gate.RECHECK_EVERY))


def test_each_round_says_where_its_time_went(target, qwen3_target, monkeypatch):
    """A round's phases (launching its own round, queueing the next, waiting for its result,
    the host's work after) add up to its seconds, and a round that was queued ahead spent
    nothing launching itself (`benchmarks/step_times.py` prints them by kind of round)."""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 30)
    monkeypatch.setenv(PIPELINE_ENV, "on")
    proposer = WrongGuesses(ids + want, 0.5, 2)
    pipe = outrider.pipeline_from_parts(target, proposer, proposer.name, max_draft=2)
    steps = [c.step for c in pipe.stream(ids, max_tokens=30, stop_tokens=set())]
    rounds = [s for s in steps if s.source == "draft"]
    phases = {"recompute", "launch", "ahead", "wait", "after"}
    assert rounds and all(set(s.phases) == phases for s in rounds)
    assert all(s.phases["recompute"] == 0.0 for s in rounds)  # no parked run to recompute
    assert all(sum(s.phases.values()) == pytest.approx(s.seconds, abs=1e-6) for s in rounds)
    launches = {True: [], False: []}
    for s in rounds:
        launches[s.ahead].append(s.phases["launch"])
    assert launches[True] and launches[False]
    assert statistics.median(launches[True]) < statistics.median(launches[False]) / 10


def test_a_round_starts_the_device_on_its_drafts_before_building_the_verify(
    target, qwen3_target, monkeypatch
):
    """Unpipelined too, a drafted round hands its drafts to the device (`mx.async_eval`) before
    it builds the verify forward, so the drafter's work runs while the host builds; the
    round's reads follow. The output stays plain greedy."""
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(qwen3_target, ids, 30)
    calls = []
    real = mx.async_eval

    def recording(*arrays):
        calls.append(arrays)
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", recording)
    got = run(target, OracleProposer(ids + want, 0.8, 262, 4, seed=3), ids, 30, 4, False)
    assert got.tokens == want and got.pipelining == (0, 0)
    drafted = [r for r in got.rounds if r.drafted]
    drafts_only = [
        i for i, call in enumerate(calls)
        if len(call) == 1 and call[0].ndim == 1 and call[0].dtype == mx.uint32
    ]  # fmt: skip
    assert len(drafts_only) == len(drafted) > 0
    assert all(i + 1 < len(calls) and len(calls[i + 1]) > 1 for i in drafts_only)  # then reads
