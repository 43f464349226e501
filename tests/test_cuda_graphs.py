"""`serve --cuda-graphs`: whether MLX's CUDA backend records kernels into CUDA graphs, chosen
before the first GPU kernel (core/cuda_graphs.py). Off a CUDA GPU nothing reads the variable,
so these tests check the choice and where serve makes it, not its speed (a benchmark's job:
docs/performance.md, "MLX's CUDA graphs and batched rounds")."""

from __future__ import annotations

import logging
import os
import socket

import pytest
from typer.testing import CliRunner

from outrider.cli import app
from outrider.core import cuda_graphs
from outrider.core.errors import OutriderError

ENV = cuda_graphs.ENV


def test_auto_turns_graphs_off_only_where_rows_batch_and_the_user_set_nothing():
    assert cuda_graphs.choose("auto", 8, {}) == "off"
    assert cuda_graphs.choose("auto", 2, {}) == "off"
    assert cuda_graphs.choose("auto", 1, {}) is None  # one row: MLX's default
    assert cuda_graphs.choose("AUTO", 8, {ENV: "1"}) is None  # the user's environment stands
    assert cuda_graphs.choose("on", 8, {ENV: "0"}) == "on"  # a flag says it outright
    assert cuda_graphs.choose(" off ", 1, {}) == "off"
    with pytest.raises(OutriderError, match="--cuda-graphs must be auto, on or off, got 'yes'"):
        cuda_graphs.choose("yes", 8, {})


@pytest.mark.parametrize(
    ("value", "state"),
    [("1", "on"), ("0", "off"), (" 2", "on"), ("false", "off"), ("on", "off"), ("", "off")],
)
def test_state_reads_the_variable_as_mlx_does(value, state):
    """MLX takes C's atoi of the value: any text without leading digits is 0, so off."""
    assert cuda_graphs.state({ENV: value}) == state
    assert cuda_graphs.state({}) == "on"


def test_apply_sets_the_variable_it_chose_and_nothing_else(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert cuda_graphs.apply("auto", 1) is None and ENV not in os.environ
    assert cuda_graphs.apply("auto", 4) == "off" and os.environ[ENV] == "0"
    assert cuda_graphs.apply("auto", 4) is None  # now the environment says it
    assert cuda_graphs.apply("on", 4) == "on" and os.environ[ENV] == "1"


@pytest.fixture
def outrider_logger():
    """serve configures the `outrider` logger; put it back for the tests after this one."""
    logger = logging.getLogger("outrider")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--max-batch", "4"], "0"),
        (["--max-batch", "4", "--cuda-graphs", "on"], "1"),
        (["--max-batch", "1"], None),
        (["--cuda-graphs", "off"], "0"),
    ],
)
def test_serve_chooses_before_it_listens_or_loads(monkeypatch, outrider_logger, args, want):
    """serve sets the variable before anything that could run a GPU kernel: here the port is
    taken, so it stops at listening, before the engine or a model, with the choice made."""
    monkeypatch.delenv(ENV, raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = CliRunner().invoke(app, ["serve", "--no-model", "--port", str(port), *args])
    assert out.exit_code == 2 and "the port is in use" in out.output, out.output
    assert os.environ.get(ENV) == want


def test_a_wrong_value_is_one_line_before_anything_runs(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    out = CliRunner().invoke(app, ["serve", "--no-model", "--cuda-graphs", "maybe"])
    assert out.exit_code == 2
    assert "--cuda-graphs must be auto, on or off, got 'maybe'" in out.output
    assert ENV not in os.environ


def test_doctor_says_what_the_environment_sets(monkeypatch):
    import json

    from outrider import doctor

    monkeypatch.setenv(ENV, "0")
    monkeypatch.setattr(doctor, "on_cuda_gpu", lambda: True)
    out = CliRunner().invoke(app, ["doctor", "--json"])
    assert json.loads(out.stdout)["cuda_graphs"].startswith(f"off ({ENV};")
    monkeypatch.delenv(ENV)
    monkeypatch.setattr(doctor, "on_cuda_gpu", lambda: False)
    out = CliRunner().invoke(app, ["doctor", "--json"])
    assert json.loads(out.stdout)["cuda_graphs"].startswith("none here (on on CUDA;")
