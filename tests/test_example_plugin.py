"""The example third-party plugin installs, is discovered, and runs losslessly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import pip_install_example, plain_greedy

import outrider
from outrider.core.plugins import Plugins

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "outrider-bigram"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    pip_install_example(EXAMPLE, site)
    sys.path.insert(0, str(site))
    yield site
    sys.path.remove(str(site))
    for name in [m for m in sys.modules if m.startswith("outrider_bigram")]:
        del sys.modules[name]


def test_plugin_is_discovered_through_entry_points(installed):
    plugins = Plugins()
    assert "bigram" in plugins.strategies
    info = {p.name: p for p in plugins.info()}
    assert "bigram" in info and not info["bigram"].builtin
    assert "outrider-bigram" in info["bigram"].version
    assert "strategy:bigram" in info["bigram"].provides


def test_plugin_appears_in_the_cli(installed):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed), str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-m", "outrider", "plugins", "--json"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert "strategy:bigram" in rows["bigram"]["provides"]


def test_plugin_runs_losslessly(installed, qwen3_target):
    pipe = outrider.load(str(qwen3_target), mode="bigram", plugins=Plugins())
    assert pipe.mode == "bigram"
    for prompt in ("abc abc abc abc", "Repeat after me: la la la"):
        ids = pipe.encode(prompt)
        want = plain_greedy(qwen3_target, ids, 64)
        got = pipe.generate(ids, max_tokens=64, stop_tokens=set())
        assert got.tokens == want
        assert sum(len(r.drafted) for r in got.rounds) > 0  # it really drafted
