"""The SmolLM2 training mix (scripts/smollm2/prompts.py) never copies an evaluation prompt.

Speed-ups are judged on the benchmark suites, which sample public evaluation sets; a training
prompt that repeats one of their lines (a task, a test, or even an instruction wrapper) would
tune the drafter to the exam. The check is on every line of 30 or more characters."""

from __future__ import annotations

import importlib.util
import json
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _prompts_module():
    spec = importlib.util.spec_from_file_location(
        "smollm2_prompts", ROOT / "scripts" / "smollm2" / "prompts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _benchmark_lines() -> set[str]:
    lines = set()
    for path in files("outrider.benchmark").joinpath("prompts").iterdir():
        if not path.name.endswith(".jsonl"):
            continue
        for row in path.read_text("utf-8").splitlines():
            for turn in json.loads(row)["turns"]:
                lines.update(ln.strip() for ln in turn.splitlines() if len(ln.strip()) >= 30)
    return lines


def test_the_mix_shares_no_line_with_the_benchmark_prompts() -> None:
    prompts = _prompts_module()
    exam = _benchmark_lines()
    assert len(exam) > 50  # the shipped suites were read
    rows = prompts.prompt_mix(3000, seed=0)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"code", "chat", "reasoning"}
    copied = {ln.strip() for r in rows for ln in r["turns"][0].splitlines() if ln.strip() in exam}
    assert not copied, f"training prompts copy benchmark lines: {sorted(copied)[:3]}"


def test_typed_prompts_show_true_examples() -> None:
    """Every doctest pair and assert a typed prompt shows holds under its reference function."""
    import random

    prompts = _prompts_module()
    refs = {t[0]: t[4] for t in prompts.TYPED}
    checked = 0
    for seed in range(200):
        lines = [ln.strip() for ln in prompts.typed(random.Random(seed)).splitlines()]
        pairs = [(a[4:], b) for a, b in zip(lines, lines[1:]) if a.startswith(">>> ")]
        pairs += [tuple(ln[7:].split(" == ", 1)) for ln in lines if ln.startswith("assert ")]
        for call, shown in pairs:
            assert eval(call, dict(refs)) == eval(shown), (seed, call, shown)
            checked += 1
    assert checked >= 400


def test_the_mix_is_the_same_every_run() -> None:
    """No prompt carries a memory address (a default argument's repr), which would change the
    mix, and so the self-distilled data, from one run to the next."""
    import re

    rows = _prompts_module().prompt_mix(3000, seed=0)
    addresses = [
        r["turns"][0] for r in rows if re.search(r"<[^<>]* at 0x[0-9a-f]+>", r["turns"][0])
    ]
    assert not addresses, addresses[:1]
