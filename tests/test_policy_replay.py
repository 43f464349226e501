"""The cap policy replayed over recorded acceptance (benchmarks/policy_replay.py): on traces of
SmolLM2 with its DSpark drafter over a chat, then code, then arithmetic (one policy across
all, as a pipeline serves them), `--max-draft auto` stays within 5% of the best fixed cap at
a GPU's and a CPU's costs. Simulated seconds, not a clock: the numbers are exact for these
traces (before the policy's OPTIMISM and PROBE_EMA it reached 77-91% of the best cap)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "docs" / "receipts" / "policy_replay_traces_smollm2_dspark.json"


def _replay_module():
    spec = importlib.util.spec_from_file_location(
        "policy_replay", ROOT / "benchmarks" / "policy_replay.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("plain_ms", "round_ms", "per_draft_ms"),
    [(5.1, 5.3, 0.33), (5.1, 8.0, 0.33), (25.0, 30.0, 6.0)],  # H200-like twice, a CPU's
)
def test_auto_keeps_up_with_the_best_fixed_cap_across_kinds_of_text(
    plain_ms, round_ms, per_draft_ms
):
    replay = _replay_module()
    saved = json.loads(TRACES.read_text())
    traces = [t for group in saved["groups"].values() for t in group]

    cost = replay.linear_cost(plain_ms, round_ms, per_draft_ms)
    ceiling = saved["ceiling"]
    fixed = [
        replay.speed(replay.replay(traces, cost, ceiling, 4, k)[0]) for k in range(ceiling + 1)
    ]
    auto = replay.speed(replay.replay(traces, cost, ceiling, 4)[0])
    assert auto >= 0.95 * max(fixed), (auto / max(fixed), fixed.index(max(fixed)))
