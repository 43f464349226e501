"""Parked runs: `--max-draft auto` holding a drafter back takes pipelined plain steps inside a
speculative generation (core/parked.py `plain_run`). Whatever the policy picks, the tokens are
plain greedy decoding's, the drafter's context stays complete, and the lookup copies a parked
run finds are verified. A long run's steps past `retap` forward no taps; where the run ends, one
forward of those tokens recomputes their rows for the drafter (`retap`): the drafter must take
in the same rows as when every step tapped."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from conftest import PROMPTS, fp32_close, plain_greedy
from test_schedule import PerStep

import outrider
from outrider import doctor
from outrider.core import loop, parked
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import OutriderError
from outrider.testing import OracleProposer, make_tiny_drafter


@pytest.mark.parametrize("accept_rate", [1.0, 0.6])
def test_auto_output_equals_plain_greedy(qwen3_target, monkeypatch, accept_rate):
    """Whatever caps the policy picks round by round (here: parked, probing, then drafting,
    forced by a policy whose costs flip halfway), the tokens are plain greedy decoding's."""
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 80)
    vocab = pipe.target.config["vocab_size"]
    oracle = OracleProposer(ids + want, accept_rate, vocab, max_draft=6, seed=1)
    seen: list[int] = []

    class Flipping(PerStep):
        def observe(self, k: int, accepted: int, seconds: float) -> None:
            seen.append(k)
            slow_verify = len(seen) < 30  # first parked, then drafting pays
            super().observe(k, accepted, 1.0 + (1.0 if slow_verify else 0.01) * k)

    monkeypatch.setattr(loop, "AutoCap", Flipping)
    auto = outrider.Pipeline(pipe.target, oracle, "oracle", 6, auto_cap=True)
    # (80 tokens: pipelined rounds choose the next cap before this round is observed, so
    # at full acceptance the policy parks a round later than unpipelined rounds would)
    got = auto.generate(ids, max_tokens=80, stop_tokens=set())
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

    class Alternating(PerStep):
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


def test_a_parked_drafter_still_verifies_what_the_text_copies(qwen3_target, drafters, monkeypatch):
    """Parked, auto takes pipelined plain steps; where the text turns out to repeat itself the
    steps stop and a round verifies the lookup copy. Copies teach the policy nothing about the
    drafter, and the output is plain greedy's."""
    pipe = outrider.load(
        str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft="auto"
    )
    # copies as long as their matches make likely: the bound a calibration puts on them
    # (`_widest`) comes from what this machine measured at load, and a busy machine measured
    # it short enough to leave copies of 2 that kept nothing (a CI run, 2026-12-06)
    pipe.proposer.calibration = None
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 80)
    seen: list[int] = []

    pays = [True]
    restarts: list[float] = []  # each parked run's first step, as the loop told the policy

    class Parked(PerStep):  # the drafter never pays: every choice parks
        def choose(self, limit: int) -> int:
            return 0

        def observe(self, k: int, accepted: int, seconds: float) -> None:
            seen.append(k)
            super().observe(k, accepted, seconds)

        def copy_pays(self, drafts: int, kept: float) -> bool:  # the next test's concern
            return pays[0]

        def observe_restart(self, seconds: float) -> None:
            restarts.append(seconds)
            super().observe_restart(seconds)

    monkeypatch.setattr(loop, "AutoCap", Parked)
    copies = pipe.proposer.lookup_rounds
    got = pipe.generate(ids, max_tokens=80, stop_tokens=set())
    assert got.tokens == want
    drafted = [r for r in got.rounds if r.drafted]
    assert drafted and len(drafted) == pipe.proposer.lookup_rounds - copies
    assert sum(r.accepted for r in drafted) > len(drafted)  # the copies were worth verifying
    assert seen and set(seen) == {0}  # plain steps only: the copies taught it nothing
    # every parked run told the policy its first step: a run before each copy, one after the
    # last (and more where runs end at the policy's say, as this one's do)
    assert len(restarts) >= len(drafted) + 1 and min(restarts) >= 0.0
    pays[0] = False  # copies that would not pay for their round: plain steps all the way
    copies = pipe.proposer.lookup_rounds
    got = pipe.generate(ids, max_tokens=80, stop_tokens=set())
    assert got.tokens == want and not got.rounds
    assert pipe.proposer.lookup_rounds == copies


# -- a long parked run's taps, recomputed where it ends ----------------------------------------

TOKENS = 60


@pytest.fixture(scope="module")
def tapped_drafters(drafters, models_dir, qwen3_target):
    """One drafter of each proposer that takes taps: block (DSpark, DFlash), DFlash 2,
    EAGLE-3."""
    return {
        "dspark": ("dspark", drafters["dspark"]),
        "dflash": ("dflash", drafters["dflash-zlab"]),
        "dflash2": (
            "dflash2",
            make_tiny_drafter(models_dir / "retap-dflash2", qwen3_target, "dflash2", "zlab"),
        ),
        "eagle3": (
            "eagle3",
            make_tiny_drafter(models_dir / "retap-eagle3", qwen3_target, "eagle3", "deepspec"),
        ),
    }


class RunsOfNine(PerStep):
    """Parks in runs of 9 plain steps, then drafts a round at cap 3, and again. Counted by what
    ran, not by calls: where rounds are pipelined (on a CUDA GPU by default), a queued round
    asks the policy too, and a 0 there leaves the loop to ask again."""

    def choose(self, limit: int) -> int:
        self.runs, self.drafted = getattr(self, "runs", 0), getattr(self, "drafted", 0)
        if self.drafted > self.runs:
            return 0
        self.drafted += 1
        return min(limit, 3)

    def plain_run(self, remaining: int) -> int:
        self.runs = getattr(self, "runs", 0) + 1
        return min(remaining, 9)


def context_rows(pipe, ids: list[int], retap: int | None) -> tuple[list[int], mx.array, int]:
    """Generate with parked runs; returns (the tokens, every context row the drafter was
    handed, in order, prompt first; how many one-row target forwards took no taps)."""
    pipe.retap_parked = retap
    proposer = getattr(pipe.proposer, "inner", pipe.proposer)
    handed: list[mx.array] = []
    start, observe, add_rows = proposer.start, proposer.observe, proposer.add_rows
    forward = pipe.target.forward
    untapped = [0]

    def on_start(prompt, taps):
        handed.clear()
        handed.append(taps)
        start(prompt, taps)

    def on_observe(accepted, taps):
        if taps is not None:
            handed.append(taps)
        observe(accepted, taps)

    def on_add_rows(taps):
        handed.append(taps)
        add_rows(taps)

    def on_forward(ids, cache, tap_ids=()):
        if ids.shape[0] == 1 and not tap_ids:
            untapped[0] += 1
        return forward(ids, cache, tap_ids)

    # the instance's own methods, so the class (and every other pipeline) is untouched
    proposer.start, proposer.observe, proposer.add_rows = on_start, on_observe, on_add_rows
    pipe.target.forward = on_forward
    try:
        got = pipe.generate(ids, max_tokens=TOKENS, stop_tokens=set())
    finally:
        for name in ("start", "observe", "add_rows"):
            del proposer.__dict__[name]
        del pipe.target.forward
    return got.tokens, mx.concatenate(handed, axis=0), untapped[0]


@pytest.mark.parametrize("name", ["dspark", "dflash", "dflash2", "eagle3"])
def test_untapped_parked_steps_hand_the_drafter_the_same_rows(
    qwen3_target, tapped_drafters, monkeypatch, name
):
    mode, drafter = tapped_drafters[name]
    monkeypatch.setattr(loop, "AutoCap", RunsOfNine)
    pipe = outrider.load(str(qwen3_target), str(drafter), mode=mode, max_draft="auto")
    ids = pipe.encode(PROMPTS[0])
    want = plain_greedy(qwen3_target, ids, TOKENS)
    tokens, rows, untapped = context_rows(pipe, ids, None)
    assert tokens == want and untapped == 0
    retapped, retapped_rows, untapped = context_rows(pipe, ids, 2)
    assert retapped == want
    assert untapped >= 10  # runs of 9 steps, the first 2 of each tapped
    # a row for every position, in order, but a last run's untapped steps: the generation
    # ended there, and nothing would read their rows
    n = retapped_rows.shape[0]
    assert rows.shape[0] - 7 <= n <= rows.shape[0]
    # one forward of a run's tokens against one forward a token: the same rows but rounding
    # (TF32's where float32 matmuls run in it: a CUDA GPU failed the float32 bound for dflash)
    assert fp32_close(retapped_rows, rows[:n], atol=1e-4, rtol=1e-4)


def test_no_retap_where_a_prefix_cache_records_the_rows(qwen3_target, drafters, monkeypatch):
    """A prefix-cache record keeps every step's rows as the cache grows, so those steps tap."""
    monkeypatch.setattr(loop, "AutoCap", RunsOfNine)
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    pipe.enable_prefix_cache(gb=0.1)
    ids = pipe.encode(PROMPTS[1])
    tokens, _, untapped = context_rows(pipe, ids, 2)
    assert tokens == plain_greedy(qwen3_target, ids, TOKENS)
    assert untapped == 0


def test_outrider_retap_chooses_where_parked_runs_recompute_their_rows(monkeypatch):
    """`auto` recomputes on a CUDA GPU only: on the CPU every row of a forward costs about a
    step, so recomputing rows never pays there. `on` and `off` force it; anything else is
    refused by name."""
    monkeypatch.delenv("OUTRIDER_RETAP", raising=False)
    assert parked.retap_from() == (parked.RETAP_FROM if on_cuda_gpu() else None)
    assert outrider.Pipeline.__dataclass_fields__["retap_parked"].default_factory() == (
        parked.retap_from()
    )
    monkeypatch.setenv("OUTRIDER_RETAP", "on")
    assert parked.retap_from() == parked.RETAP_FROM
    assert doctor.doctor_report()["parked_taps"] == f"recomputed past {parked.RETAP_FROM} steps"
    monkeypatch.setenv("OUTRIDER_RETAP", "OFF")
    assert parked.retap_from() is None
    assert doctor.doctor_report()["parked_taps"] == "every step"
    monkeypatch.setenv("OUTRIDER_RETAP", "sometimes")
    with pytest.raises(OutriderError, match="OUTRIDER_RETAP must be auto, on or off"):
        parked.retap_from()
    report = doctor.doctor_report()
    assert report["parked_taps"] is None
    assert any("OUTRIDER_RETAP" in p for p in report["problems"])


def test_the_round_after_a_parked_run_is_timed_with_its_recompute(
    qwen3_target, drafters, monkeypatch
):
    """A run's untapped rows are recomputed as the first work of the round that ends it (a
    probe, a lookup copy), inside that round's timing: the policy weighs a probe by what it
    cost, recompute included. Here the recompute is made to take 100 s of the loop's clock."""
    seconds_after: list[tuple[bool, float]] = []  # (a recompute came first, the round's time)
    recomputed = [False]

    class Clock:  # the loop's `time` module: real time plus what recomputes "took"
        extra = 0.0

        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + Clock.extra

    retap = parked.retap

    def slow_retap(*args) -> None:
        Clock.extra += 100.0
        recomputed[0] = True
        retap(*args)

    class Recording(RunsOfNine):
        def observe(self, k: int, accepted: int, seconds: float) -> None:
            if k > 0:
                seconds_after.append((recomputed[0], seconds))
                recomputed[0] = False
            super().observe(k, accepted, seconds)

    monkeypatch.setattr(loop, "AutoCap", Recording)
    monkeypatch.setattr(loop, "time", Clock)
    monkeypatch.setattr(parked, "retap", slow_retap)
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    pipe.retap_parked = 2
    ids = pipe.encode(PROMPTS[0])
    chunks = list(pipe.stream(ids, max_tokens=TOKENS, stop_tokens=set(), max_draft="auto"))
    assert chunks[-1].result.tokens == plain_greedy(qwen3_target, ids, TOKENS)
    after = [s for first, s in seconds_after if first]
    others = [s for first, s in seconds_after if not first]
    assert after and others  # runs of 9 ended by rounds, and rounds after rounds
    assert min(after) >= 100.0 > max(others)
    # and the round's phases tell the recompute apart from its launch
    rounds = [c.step for c in chunks if c.step.source == "draft" and c.step.phases]
    recomputes = [s.phases["recompute"] for s in rounds]
    assert max(recomputes) >= 100.0 and min(recomputes) == 0.0
    assert all(s.phases["launch"] < 100.0 for s in rounds)
