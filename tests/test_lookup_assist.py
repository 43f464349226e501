"""Lookup drafts inside model rounds: where the text copies the context, a round verifies the
copy (longer than the drafter's cap) instead of the drafter's guess; output stays the target's."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core.calibration import Calibration
from outrider.plugins.strategies.lookup_assist import LookupAssist


@pytest.fixture(scope="module")
def dspark(qwen3_target, drafters):
    return outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")


def assisted(pipe, **kwargs):
    inner = getattr(pipe.proposer, "inner", pipe.proposer)
    wrapped = LookupAssist(inner, **kwargs)
    return outrider.pipeline_from_parts(pipe.target, wrapped, pipe.mode, max_draft=4), wrapped


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[2] + " " + PROMPTS[2]])
def test_copying_rounds_draft_the_copy_and_output_stays_plain_greedy(dspark, qwen3_target, prompt):
    pipe, wrapped = assisted(dspark)
    ids = pipe.encode(prompt)
    got = pipe.generate(ids, max_tokens=80, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 80)
    wide = [r for r in got.rounds if len(r.drafted) > 4]
    assert wide and len(wide) <= wrapped.lookup_rounds  # only lookup rounds go past the cap
    assert all(r.accepted <= len(r.drafted) for r in got.rounds)


def test_sampled_path_with_lookup_rounds_follows_the_target(dspark, qwen3_target):
    """The sampled acceptor takes lookup drafts as one-hot proposals: with top_k = 1 the
    target's distribution is a point mass, so sampling must give plain greedy output, through
    lookup rounds and drafter rounds alike."""
    pipe, wrapped = assisted(dspark)
    ids = pipe.encode(PROMPTS[1])
    got = pipe.generate(ids, max_tokens=80, temperature=0.7, top_k=1, seed=3, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 80)
    assert wrapped.lookup_rounds > 0


def test_a_calibrated_curve_bounds_the_copy_by_its_cost():
    class Inner:
        name, tap_layer_ids, max_draft = "x", (), 4

    steep = Calibration(key={}, verify_ms={64: [1.0 + 0.5 * w for w in range(40)]})
    flat = Calibration(key={}, verify_ms={64: [1.0 + 0.01 * w for w in range(40)]})
    assert LookupAssist(Inner(), calibration=steep)._widest() == 2  # 2.0 ms <= 2 x 1.0 ms
    assert LookupAssist(Inner(), calibration=flat, max_lookup=32)._widest() == 32
    text = list(range(50)) + list(range(40))  # the last 40 tokens copy the first 40
    room = 100
    copy = LookupAssist(Inner(), max_lookup=32)._copy(text, room)
    assert copy == list(range(40, 50)) + list(range(22))  # 2 x match, at most 32
    assert LookupAssist(Inner(), calibration=steep)._copy(text, room) == [40, 41]
    assert LookupAssist(Inner())._copy(text, 3) == [40, 41, 42]  # never past the tokens left
    assert LookupAssist(Inner())._copy([1, 2, 3, 9, 1, 2, 3], room) == []  # match < min_match


def test_a_given_cap_bounds_the_copy_and_the_copy_still_drafts(dspark, qwen3_target):
    """With --max-draft given, a copy may be no longer than the cap; one that fills it still
    drafts the round where the drafter has been getting less accepted (before, a copy had to
    be longer than the cap, so a given cap switched lookup drafts off)."""
    pipe, wrapped = assisted(dspark)
    ids = pipe.encode(PROMPTS[1])
    got = pipe.generate(ids, max_tokens=80, max_draft=4, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 80)
    assert wrapped.lookup_rounds > 0
    assert max(len(r.drafted) for r in got.rounds) <= 4


def test_copy_ready_says_what_a_one_draft_round_would_draft():
    class Inner:
        name, tap_layer_ids, max_draft = "x", (), 4

    text = list(range(50)) + list(range(40))  # the last 40 tokens copy the first 40
    assist = LookupAssist(Inner())
    assert assist.copy_ready(text, 100)
    assert not assist.copy_ready(text, 0)  # no token left to draft
    assert not assist.copy_ready(list(range(90)), 100)  # nothing repeats
    assist._accepted = 40.0  # a drafter getting more accepted than the copy would carry
    assert not assist.copy_ready(text, 100)


def test_the_longest_copy_is_a_load_option(qwen3_target, drafters):
    """`load(lookup_long_draft=N)` (`--lookup-long-draft N`, `/admin/load`) bounds a drafter
    round's copy at N and mode lookup's widest draft; the output stays plain greedy, and a
    value outside 1..256 is refused by name."""
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), "dspark", lookup_long_draft=6)
    assert isinstance(pipe.proposer, LookupAssist) and pipe.proposer.max_lookup == 6
    ids = pipe.encode(PROMPTS[2] + " " + PROMPTS[2])
    got = pipe.generate(ids, max_tokens=60, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 60)
    assert pipe.proposer.lookup_rounds > 0 and max(len(r.drafted) for r in got.rounds) <= 6
    wide = outrider.load(str(qwen3_target), str(drafters["dspark"]), "dspark")
    assert wide.proposer.max_lookup == 32
    unbounded = wide.generate(ids, max_tokens=60, stop_tokens=set())
    assert unbounded.tokens == got.tokens and max(len(r.drafted) for r in unbounded.rounds) > 6
    lookup = outrider.load(str(qwen3_target), mode="lookup", lookup_long_draft=24)
    assert lookup.proposer.max_draft == 24
    for bad in (0, 257):
        with pytest.raises(outrider.OutriderError, match="--lookup-long-draft"):
            outrider.load(str(qwen3_target), mode="lookup", lookup_long_draft=bad)


@pytest.mark.parametrize("max_lookup", [1, 7, 32, 256])
def test_a_copy_is_the_latest_matchs_continuation_however_far_back_it_runs(max_lookup):
    """`_copy` follows a match back only as far as can lengthen the copy (a parked run asks
    after every plain step); its copies equal those of the whole match, found by brute force,
    on texts that copy themselves in long and short stretches."""
    import random

    class Inner:
        name, tap_layer_ids, max_draft = "x", (), 4

    rng = random.Random(max_lookup)
    body = [rng.randrange(6) for _ in range(300)]  # a small alphabet: many short matches too
    text = body + body[:200] + [rng.randrange(6) for _ in range(100)]
    assist, n, copies = LookupAssist(Inner(), max_lookup=max_lookup), 4, 0
    for m in range(n, len(text)):
        tokens, room = text[:m], rng.choice([3, 50, 1000])
        ends = [e for e in range(n - 1, m - 1) if tokens[e - n + 1 : e + 1] == tokens[m - n :]]
        want = []
        if ends:
            e, length = ends[-1], n
            while e - length >= 0 and tokens[e - length] == tokens[m - 1 - length]:
                length += 1
            want = tokens[e + 1 : e + 1 + min(2 * length, max_lookup, room)]
        assert assist._copy(tokens, room) == want, m
        copies += bool(want)
    assert copies > 200  # the copied stretch and the small alphabet's matches were reached
