"""The one-row step benchmarks measure what they say: `benchmarks/plain_step.py`'s arms (mlx-lm's
loop, bare loops, outrider's pipeline, a tapped forward) decode the same tokens, and
`benchmarks/compiled_blocks.py`'s compiled layers (merged products too) compute what the layer
computes, and `benchmarks/parked_steps.py --host-only`'s replayed forward decodes the real answer
in every arm. Their timings are for a GPU; these check only that the arms being timed do the same
work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_plain_step_arm_decodes_the_same_tokens():
    bench = _benchmark("plain_step")
    from outrider.api import load

    target = load("outrider-demo/target", None, mode="baseline").target
    target.install_taps((1, 2, 3, 4, 5))
    bench.ARMS["tapped"] = bench.tapped_arm((1, 2, 3, 4, 5))
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(40)]
    runs = {name: arm(target, prompt, 12) for name, arm in bench.ARMS.items()}
    want = runs["mlx-lm"][1][:12]
    assert len(want) == 12
    for name, (gaps, tokens, parts) in runs.items():
        assert tokens[:12] == want, name
        assert gaps and all(g > 0 for g in gaps), name
        if parts:  # the bare loops split each step in three
            assert set(parts) == {"build", "launch", "wait"} and len(parts["wait"]) == len(gaps)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("compiled", "fp32"),
        ("merged", "fp32"),
        pytest.param("merged", "4bit", marks=pytest.mark.slow),
    ],
)
def test_compiled_blocks_compute_what_the_layer_computes(kind, dtype):
    """The compiled layer, and the one with q/k/v and gate/up each as one product (plain and
    quantized weights joined), give the layer's logits at every step."""
    bench = _benchmark("compiled_blocks")
    plain = bench.make_model("tiny", dtype, False)
    compiled = bench.make_model("tiny", dtype, True if kind == "compiled" else kind)
    blocks = bench.MergedBlocks if kind == "merged" else bench.CompiledBlocks
    assert all(type(layer) is blocks for layer in compiled.model.layers)
    prompt = [(5 * i + 1) % 500 + 3 for i in range(30)]
    _, want, _, want_rows = bench.steps(plain, prompt, 10)
    _, got, parts, rows = bench.steps(compiled, prompt, 10)
    assert got == want
    assert len(rows) == len(want_rows) == 9 and set(parts) == {"build", "launch", "wait"}
    for a, b in zip(rows, want_rows):  # every step's logits, positions and all
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_the_replayed_forward_decodes_the_real_answer_in_every_parked_arm(monkeypatch):
    """`parked_steps.py --host-only` times the loop's host work over a forward that does no
    model work: each arm must still decode the real answer (so lookup copies and shadow drafts
    meet the real text), parked runs tapping as on a GPU (OUTRIDER_RETAP=on) and rolling back."""
    monkeypatch.setenv("OUTRIDER_RETAP", "on")
    bench = _benchmark("parked_steps")
    from outrider.api import load

    base = load("outrider-demo/target", None, mode="baseline")
    prompt = base.encode("Write a short poem about the sea.")
    answer = base.generate(prompt, max_tokens=24).tokens
    arms = [base]
    for mode, drafter in (("lookup", None), ("dspark", "outrider-demo/dspark")):
        pipe = load("outrider-demo/target", drafter, mode=mode, target=base.target)
        bench.hold_parked(pipe)
        arms.append(pipe)
    replay = bench.ReplayedForward(base.target)
    base.target._run = replay
    replay.play(prompt + answer)
    for pipe in arms:
        kw = {} if pipe is base else {"max_draft": "auto"}
        steps = bench.steps_of(pipe, prompt, 24, **kw)
        assert len(steps) == 23, pipe.mode
        assert pipe.generate(prompt, max_tokens=24, **kw).tokens == answer, pipe.mode
    replay.play(prompt + answer[:10] + [answer[10] + 1] + answer[11:])  # a text it never saw
    assert base.generate(prompt, max_tokens=12).tokens[10] == answer[10] + 1
