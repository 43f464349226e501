"""A third-party drafter *format* plugin (examples/outrider-flatpack) installs, is discovered,
claims its checkpoints, and runs them losslessly: the same weights drafted from its packaging
and from DeepSpec's give the same drafts, round by round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import pip_install_example, plain_greedy

import outrider
from outrider.api import load_drafter
from outrider.core.errors import CheckpointError
from outrider.core.plugins import Plugins
from outrider.testing import make_tiny_drafter

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "outrider-flatpack"


@pytest.fixture(scope="module")
def flatpack(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    pip_install_example(EXAMPLE, site)
    sys.path.insert(0, str(site))
    import outrider_flatpack

    yield outrider_flatpack
    sys.path.remove(str(site))
    for name in [m for m in sys.modules if m.startswith("outrider_flatpack")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def checkpoints(flatpack, qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("flatpack")
    deepspec = make_tiny_drafter(root / "deepspec", qwen3_target, "dspark", "deepspec")
    return deepspec, flatpack.repack(deepspec, root / "flatpack")


def test_format_plugin_is_discovered_and_claims_its_checkpoints(flatpack, checkpoints):
    plugins = Plugins()
    assert "flatpack" in plugins.formats
    info = {p.name: p for p in plugins.info()}
    assert "format:flatpack" in info["flatpack"].provides and not info["flatpack"].builtin
    spec = load_drafter(plugins, str(checkpoints[1]), download=False)
    assert spec.format == "flatpack" and spec.kind == "dspark"
    assert not any(k.startswith("decoder.") for k in spec.weights)


def test_repacked_drafter_drafts_what_the_original_does(flatpack, checkpoints, qwen3_target):
    plugins = Plugins()
    runs = []
    for drafter in checkpoints:
        pipe = outrider.load(
            str(qwen3_target), str(drafter), mode="dspark", plugins=plugins, drafter_bits=16
        )
        ids = pipe.encode("def fibonacci(n):")
        runs.append(pipe.generate(ids, max_tokens=40, max_draft=4, stop_tokens=set()))
    want = plain_greedy(qwen3_target, ids, 40)
    assert runs[0].tokens == runs[1].tokens == want
    assert [r.drafted for r in runs[0].rounds] == [r.drafted for r in runs[1].rounds]


def test_damaged_flatpack_checkpoint_is_refused_by_name(flatpack, checkpoints, tmp_path):
    import json

    bad = flatpack.repack(checkpoints[0], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["flatpack"]["mask_token_id"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(Plugins(), str(bad), download=False)
