"""The race (`/v1/race`, server/race.py) without a server: where two arms' tokens part and what
each side took there, and the arms a race builds over a loaded pipeline (other modes over its
target, the loaded drafter at its own confidence threshold). The race through a live server and
the page is tests/test_web_ui.py's."""

from __future__ import annotations

import pytest

from outrider.server.race import divergence, first_difference


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_divergence_names_each_sides_token():
    """The race's verdict says which token each arm took where they part, or that one only
    stopped earlier."""

    class Letters:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    assert divergence([1, 2], [1, 2], Letters()) == {"first_difference": None}
    apart = divergence([1, 2, 3], [1, 5, 3], Letters())
    assert apart == {
        "first_difference": 1, "length_only": False,
        "reference_token": {"id": 2, "text": "b"}, "arm_token": {"id": 5, "text": "e"},
    }  # fmt: skip
    shorter = divergence([1, 2, 3], [1, 2], Letters())
    assert shorter["length_only"] and shorter["arm_token"] is None
    assert shorter["reference_token"] == {"id": 3, "text": "c"}


def test_race_arms_of_other_modes_run_over_a_drafter_pipelines_target():
    """Over a target a drafter taps (the demo pair's DSpark), the baseline and lookup arms a
    race builds decode what the loaded pipeline decodes, baseline without a round, and leave
    the loaded pipeline as it was."""
    import outrider
    from outrider.server.race import mode_pipeline

    pipe = outrider.load("outrider-demo/target", "outrider-demo/dspark", mode="dspark")
    prompt, kw = "Write a Python function that reverses a list.", {"max_tokens": 32}
    want = pipe.generate(prompt, **kw).tokens
    baseline, lookup = mode_pipeline(pipe, "baseline"), mode_pipeline(pipe, "lookup")
    assert baseline.target is lookup.target is pipe.target
    plain = baseline.generate(prompt, **kw)
    assert plain.tokens == want and not plain.rounds and baseline.max_draft == 0
    assert lookup.generate(prompt, **kw).tokens == want and lookup.max_draft > 0
    assert pipe.generate(prompt, **kw).tokens == want


def test_a_race_arm_runs_the_loaded_drafter_at_its_own_confidence_threshold(models_dir):
    """`{"mode": "dspark", "confidence": c}`: the loaded DSpark drafter cutting its drafts at
    cumulative confidence c, in a pipeline of its own over the same target and drafter: the
    same tokens as the arm without it, fewer drafts a round at a high threshold, and the loaded
    pipeline's own threshold untouched. Elsewhere (a drafter without a confidence head, or
    another mode's arm) the arm is refused by name."""
    from test_families import built

    import outrider
    from outrider.server.errors import ApiError
    from outrider.server.race import RaceArm, arm_list, mode_pipeline

    target, drafter = built(models_dir, "qwen3")
    pipe = outrider.load(str(target), str(drafter), mode="dspark")
    opts = {"max_tokens": 24, "stop_tokens": set()}
    arms = arm_list(pipe, opts, None, [RaceArm(mode="dspark", cap=4),
                                       RaceArm(mode="dspark", cap=4, confidence=0.999)])  # fmt: skip
    assert [name for name, *_ in arms] == ["dspark cap 4", "dspark cap 4 confidence 0.999"]
    ids = list(range(3, 40))
    results = [(own or pipe).generate(ids, **o) for _, o, _, own in arms]
    assert results[0].tokens == results[1].tokens
    drafted = [sum(len(s.drafted) for s in r.rounds) / len(r.rounds) for r in results]
    assert drafted[1] < drafted[0], drafted  # cut at the threshold
    assert arms[1][3].target is pipe.target and not pipe.proposer.use_confidence
    lookup = mode_pipeline(pipe, "lookup")
    for loaded, arm in ((lookup, RaceArm(mode="lookup", confidence=0.5)),
                        (pipe, RaceArm(mode="lookup", confidence=0.5))):  # fmt: skip
        with pytest.raises(ApiError, match="confidence applies to the loaded drafter"):
            arm_list(loaded, opts, None, [RaceArm(mode=loaded.mode), arm])
