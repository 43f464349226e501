"""Lookup mode's copies while `--max-draft auto` has parked it: a parked run stops for the
continuation of a long match, whose drafts the text has been repeating, and not for a
one-token match's, whose drafts it has not; the output is plain greedy decoding's either way."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import loop
from outrider.core.schedule import AutoCap
from outrider.plugins.strategies.lookup import LookupProposer, MatchRates


def parked_steps(proposer: LookupProposer, history: list[int], tokens: list[int]) -> list[int]:
    """Feed `tokens` one at a time as a parked run does (`copy_ready` after each); the copy's
    length at each step (0: none offered)."""
    offered = []
    for token in tokens:
        history.append(token)
        offered.append(proposer.copy_ready(history, 100))
    return offered


def test_rates_are_learnt_per_match_kind_from_the_tokens_that_follow():
    proposer = LookupProposer(max_draft=8)
    proposer.start([], None)
    history: list[int] = []
    # tokens that recur with something new after them each time: a one-token match's
    # continuation is wrong at once, and none is offered
    for i in range(10):
        assert parked_steps(proposer, history, [40, 1000 + i, 41, 1100 + i]) == [0] * 4
    rates = proposer.rates
    assert rates.checks[1] >= 5 and rates.kept[1] == 0.0
    # a passage the text repeats whole: its copies start on short matches, then run on long
    # ones, and what they keep raises those kinds' estimates until a copy is offered
    passage = list(range(200, 240))
    offered = []
    for _ in range(6):
        offered += parked_steps(proposer, history, passage + [7])
    assert offered[:41] == [0] * 41 and max(offered) == 8
    assert parked_steps(proposer, history, passage[:20])[-1] == 8
    n = proposer._offer[1]  # the kind of match that found it: 4 tokens, running back over
    assert n == 4 + 3 and rates.kept[n] > 1.0  # the passages before: the longest kind
    assert proposer.copy_rate == min(1.0, rates.kept[n] / 8)
    assert rates.kept[n] > 2 * rates.kept[1]
    # a recurring token, which only a one-token match continues, is still not worth a round;
    # nor would it be whatever its estimate read (`COPY_MATCH`)
    assert parked_steps(proposer, history, [40]) == [0] and proposer.copy_rate == 0.0
    rates.kept[1] = 8.0
    assert parked_steps(proposer, history, [41]) == [0] and proposer.copy_rate == 0.0


def test_a_match_kind_no_check_has_reached_offers_no_copy():
    rates = MatchRates(4)
    assert rates.kept == [0.0] * 5 and rates.checks == [0] * 5
    rates.learn(2, 3)  # from 0, a step at a time: one lucky check buys nothing
    assert rates.kept[2] == pytest.approx(0.3) and rates.checks[2] == 1
    assert rates.snapshot() == {"kept": [0.0, 0.0, 0.3, 0.0, 0.0], "checks": [0, 0, 1, 0, 0]}
    proposer = LookupProposer(max_draft=8)
    proposer.start([], None)
    history = [5, 6, 7, 8, 9, 5, 6, 7, 8]  # the text repeats: a 4-token match, never checked
    assert proposer.copy_ready(history, 100) == 0


def test_a_long_match_is_told_from_a_phrase():
    """A match of max_n tokens is classed by how far back it runs: doublings of max_n."""
    from outrider.plugins.strategies.lookup import _longer

    text = list(range(100, 140))
    for back, kind in ((4, 0), (7, 0), (8, 1), (15, 1), (16, 2), (31, 2), (32, 3), (40, 3)):
        tokens = text + [1] + text[40 - back :]  # the last `back` tokens repeat, no more
        assert _longer(tokens, 40, 4) == kind, back


def test_forks_share_what_was_learnt():
    from outrider.core.batch import fork

    proposer = LookupProposer(max_draft=8)
    other = fork(proposer)
    other.start([], None)
    assert other.rates is proposer.rates


@pytest.mark.parametrize("pays", [True, False])
def test_parked_lookup_verifies_offered_copies_whole_and_stays_plain_greedy(
    qwen3_target, monkeypatch, pays
):
    """Held parked, lookup mode's steps stop where a copy is offered and pays: its round
    verifies the whole copy (past the policy's cap of 1), as a copy (it teaches the policy's
    per-position acceptance nothing); where copies never pay, no round runs."""
    pipe = outrider.load(str(qwen3_target), mode="lookup")
    ids = pipe.encode(PROMPTS[2])
    want = plain_greedy(qwen3_target, ids, 160)
    asked: list[tuple[int, float]] = []

    class Parked(AutoCap):
        def choose(self, limit: int) -> int:
            return 0

        def copy_pays(self, drafts: int, kept: float) -> bool:
            asked.append((drafts, kept))
            return pays

    monkeypatch.setattr(loop, "AutoCap", Parked)
    auto = outrider.Pipeline(pipe.target, pipe.proposer, "lookup", 16, auto_cap=True)
    got = auto.generate(ids, max_tokens=160, stop_tokens=set())
    assert got.tokens == want
    assert asked  # copies were offered: the tiny model's text repeats itself
    # every offer's expected tokens come from its match's rate: more than one draft kept
    assert all(kept >= 2.0 for _, kept in asked)
    if not pays:
        assert not got.rounds
        return
    drafted = [r for r in got.rounds if r.drafted]
    assert drafted and any(len(r.drafted) > 1 for r in drafted)  # whole copies, not cap 1
    assert auto.cap_policy.drafting == 0  # copies, not drafting rounds: acceptance untaught


def test_the_replay_benchmark_prices_copies_at_the_costs_it_is_given(
    qwen3_target, capsys, monkeypatch
):
    """`benchmarks/lookup_copies.py` on the tiny target: where a copy round costs a second no
    copy is taken and the modelled speed-up is plain decoding's; where it costs a plain step,
    copies are taken and each kind's row says what they were expected to keep and kept."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lookup_copies.py"
    spec = importlib.util.spec_from_file_location("lookup_copies", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["lookup_copies.py", "--model", str(qwen3_target), "--kinds", "chat", "--prompts", "2"]
    argv += ["--max-tokens", "48", "--plain-ms", "1.0", "--restart-ms", "0"]
    for round_ms, taken in (("1000", False), ("1.0", True)):
        monkeypatch.setattr(sys, "argv", [*argv, "--round-ms", round_ms])
        bench.main()
        out = capsys.readouterr().out
        rows = out.split("kept\n", 1)[1].strip().splitlines()
        assert "speed-up" in out
        if not taken:
            assert "speed-up 1.000x" in out and rows == []
        else:
            assert rows and all(len(row.split()) == 4 for row in rows)
