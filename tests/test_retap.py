"""A parked run's steps past `retap` forward no taps; where the run ends, one forward of those
tokens recomputes their rows for the drafter (core/loop.py, `_plain_run` and `_retap`). The
drafter must take in the same context rows as when every step tapped, and the output must stay
plain greedy decoding's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy
from test_schedule import PerStep

import outrider
from outrider import doctor
from outrider.core import loop
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import OutriderError
from outrider.testing import make_tiny_drafter

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


class Alternating(PerStep):
    """Parks in runs of 9 plain steps, then drafts a round at cap 3, and again."""

    def choose(self, limit: int) -> int:
        self.asked = getattr(self, "asked", 0) + 1
        return 0 if self.asked % 2 else min(limit, 3)

    def plain_run(self, remaining: int) -> int:
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
    monkeypatch.setattr(loop, "AutoCap", Alternating)
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
    assert mx.allclose(retapped_rows, rows[:n], atol=1e-4, rtol=1e-4).item()


def test_no_retap_where_a_prefix_cache_records_the_rows(qwen3_target, drafters, monkeypatch):
    """A prefix-cache record keeps every step's rows as the cache grows, so those steps tap."""
    monkeypatch.setattr(loop, "AutoCap", Alternating)
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
    assert loop.retap_from() == (loop.RETAP_FROM if on_cuda_gpu() else None)
    assert outrider.Pipeline.__dataclass_fields__["retap_parked"].default_factory() == (
        loop.retap_from()
    )
    monkeypatch.setenv("OUTRIDER_RETAP", "on")
    assert loop.retap_from() == loop.RETAP_FROM
    assert doctor.doctor_report()["parked_taps"] == f"recomputed past {loop.RETAP_FROM} steps"
    monkeypatch.setenv("OUTRIDER_RETAP", "OFF")
    assert loop.retap_from() is None
    assert doctor.doctor_report()["parked_taps"] == "every step"
    monkeypatch.setenv("OUTRIDER_RETAP", "sometimes")
    with pytest.raises(OutriderError, match="OUTRIDER_RETAP must be auto, on or off"):
        loop.retap_from()
    report = doctor.doctor_report()
    assert report["parked_taps"] is None
    assert any("OUTRIDER_RETAP" in p for p in report["problems"])
