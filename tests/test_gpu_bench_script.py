"""`scripts/gpu_bench.sh` checks every set name before it runs anything (a device call is
scarce; a typo must not cost one), so the names it accepts and the sets it runs must agree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"


def test_the_sets_it_accepts_are_the_sets_it_runs():
    text = SCRIPT.read_text()
    accepted = set(re.search(r'^sets="([^"]*)"', text, re.M).group(1).split())
    dispatch = text[text.index('  case "$set" in') :]
    labels = re.findall(r"^    ([a-z0-9][a-z0-9 |]*)\)", dispatch, re.M)
    run = {name.strip() for label in labels for name in label.split("|")}
    assert run and accepted == run, (accepted - run, run - accepted)
    usage = set(re.findall(r"^#   ([a-z0-9]+) ", text, re.M))  # the header's one line per set
    assert run <= usage, run - usage


def test_a_wrong_set_name_stops_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), "trace", "no-such-set"],
        env={"OUT": str(out), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "no set named no-such-set" in done.stderr and "retapfrom" in done.stderr
    assert not (out / "gpu.txt").exists()  # nothing ran, not even the device query
