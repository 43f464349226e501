"""The demo pair: the recipe at its tiny preset, drafters stored quantised, and the default
`outrider generate` target."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import plain_greedy
from typer.testing import CliRunner

from outrider import cli
from outrider.api import load
from outrider.core.errors import CheckpointError
from outrider.core.quantized import dequantize_tensors, quantize_checkpoint
from outrider.registry import find_pair
from outrider.testing import SPECIAL_TOKENS, make_tiny_drafter, make_tiny_target

ROOT = Path(__file__).resolve().parents[1]
HAS_TRAIN = importlib.util.find_spec("outrider.train") is not None
PROMPT = "def parse("


def start_recipe(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """scripts/make_demo_pair.py in a process group of its own, so `end_group` can reach every
    process it starts (its drafter workers included)."""
    cmd = [sys.executable, "scripts/make_demo_pair.py", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, cwd=ROOT, text=True, env=env, start_new_session=True, **popen)


def end_group(proc: subprocess.Popen) -> None:
    """Whatever way a test ends (a failure, Ctrl-C), nothing the recipe started outlives it:
    SIGTERM to the whole group (the recipe cleans up on it), SIGKILL to whatever remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is empty
        if sig == signal.SIGTERM:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


@dataclass
class RecipeRun:
    returncode: int
    stdout: str
    stderr: str
    pid: int  # the recipe's process: its scratch folder is named with it


def run_recipe(*args: str, env: dict | None = None) -> RecipeRun:
    """The recipe to its end, however long it takes (no wall-clock limit), then its group ended."""
    proc = start_recipe(*args, env=env)
    try:
        stdout, stderr = proc.communicate()
    finally:
        end_group(proc)
    return RecipeRun(proc.returncode, stdout, stderr, proc.pid)


def group_workers(pgid: int) -> list[int]:
    """Drafter workers (multiprocessing spawn children) still alive in process group `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if int(fields[2]) == pgid and b"spawn_main" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The real recipe at --preset tiny (drafters too once `outrider train` is present)."""
    out = tmp_path_factory.mktemp("recipe") / "pair"
    args = ["--preset", "tiny", "--out", str(out)]
    if not HAS_TRAIN:
        args.append("--skip-drafters")
    # The system temp folder, not a fresh one: MLX's CPU backend keeps the kernels `mx.compile`
    # builds there, and an empty TMPDIR makes the recipe rebuild them (~4x slower).
    temp = Path(tempfile.gettempdir())
    proc = run_recipe(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # its scratch folder (named with its pid: other workers' recipes may be running) went
    assert not list(temp.glob(f"outrider-demo-{proc.pid}-*"))
    assert "total" in proc.stdout and "hardware" in proc.stdout  # the summary was printed
    return out


@pytest.mark.slow  # the whole recipe, training included (~20 s on two cores)
def test_recipe_trains_a_small_quantised_model(recipe):
    summary = json.loads((recipe / "recipe.json").read_text())
    assert summary["val_loss_float"] < summary["val_loss_start"] - 0.5  # it learned
    assert abs(summary["val_loss_quantized"] - summary["val_loss_float"]) < 0.1
    assert summary["total_mb"] <= 16 and summary["sizes_mb"]["target"] > 0
    assert summary["corpus"]["licence"].startswith("PSF") and summary["corpus"]["files"] > 0
    assert (recipe / "target" / "CORPUS-LICENSE.txt").is_file()
    config = json.loads((recipe / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["quantization"]["bits"] == 8
    tok_config = json.loads((recipe / "target" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow  # uses the recipe's output
def test_recipe_output_loads_with_mlx_lm_and_generates_losslessly(recipe):
    from mlx_lm.utils import load as mlx_load

    model, tokenizer = mlx_load(str(recipe / "target"))
    assert len(tokenizer.vocab) == model.args.vocab_size == 512
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == 511  # specials last: drafters' mask
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    modes = ["lookup", "dspark", "dflash"] if HAS_TRAIN else ["lookup"]
    for mode in modes:
        drafter = str(recipe / mode) if mode != "lookup" else None
        if drafter:  # stored 4-bit by the recipe
            assert (
                json.loads((recipe / mode / "config.json").read_text())["quantization"]["bits"] == 4
            )
        pipe = load(str(recipe / "target"), drafter, mode)
        ids = pipe.encode(PROMPT)
        result = pipe.generate(ids, max_tokens=32, stop_tokens=set())
        assert result.tokens == plain_greedy(recipe / "target", ids, 32), mode


@pytest.mark.slow  # uses the recipe's output
def test_recipe_reuses_a_built_target_with_target_flag(recipe, tmp_path):
    """--target skips stages 1-4: the target folder is copied as is, and the recipe says so."""
    out = tmp_path / "again"
    args = ["--preset", "tiny", "--out", str(out)]
    proc = run_recipe(*args, "--target", str(recipe / "target"), "--skip-drafters")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "recipe.json").read_text())
    assert summary["target_reused"] == str((recipe / "target").resolve())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (out / "target" / name).read_bytes() == (recipe / "target" / name).read_bytes()
    assert "reused from" in proc.stdout
    bad = run_recipe(*args, "--target", str(tmp_path), "--skip-drafters")
    assert bad.returncode != 0 and "not a model folder" in bad.stderr


@pytest.mark.slow  # uses the recipe's output
@pytest.mark.skipif(not HAS_TRAIN, reason="the drafter stage needs `outrider train`")
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="lists processes via /proc")
def test_sigterm_during_drafter_training_stops_workers_and_removes_scratch(recipe, tmp_path):
    """SIGTERM while both drafter workers train: the recipe stops them, removes its scratch
    folder and exits 128 + 15; no worker is left in its process group."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = ["--preset", "tiny", "--out", str(tmp_path / "pair"), "--target", str(recipe / "target")]
    proc = start_recipe(*args, env={"TMPDIR": str(scratch)}, stderr=subprocess.STDOUT)
    try:
        seen = []
        for line in proc.stdout:  # no clock: a worker announces its training, or EOF ends this
            seen.append(line)
            if "outrider train --kind" in line:
                break
        assert list(scratch.glob("outrider-demo-*")), "".join(seen)  # its scratch folder
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait() == 128 + signal.SIGTERM, "".join(seen) + rest
        assert "SIGTERM: cleaning up" in rest
        assert group_workers(proc.pid) == []
        assert not list(scratch.glob("outrider-demo-*"))
    finally:
        end_group(proc)


def test_quantised_drafter_checkpoint_loads_and_stays_lossless(tmp_path, qwen3_target):
    drafter = make_tiny_drafter(tmp_path / "float", qwen3_target, "dspark", block_size=4)
    packed = shutil.copytree(drafter, tmp_path / "packed")
    quantize_checkpoint(packed, bits=4)
    sizes = [sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (drafter, packed)]
    assert sizes[1] < sizes[0] / 3
    config = json.loads((packed / "config.json").read_text())
    restored = dequantize_tensors(mx.load(str(packed / "model.safetensors")), config)
    original = mx.load(str(drafter / "model.safetensors"))
    assert restored.keys() == original.keys()
    w = "layers.0.mlp.up_proj.weight"
    err = mx.abs(restored[w].astype(mx.float32) - original[w]).max().item()
    assert 0 < err < 0.2 * mx.abs(original[w]).max().item()
    pipe = load(str(qwen3_target), str(packed), "dspark")
    ids = pipe.encode(PROMPT)
    result = pipe.generate(ids, max_tokens=24, stop_tokens=set())
    assert result.tokens == plain_greedy(qwen3_target, ids, 24)
    del config["quantization"]
    with pytest.raises(CheckpointError, match="no quantization"):
        dequantize_tensors(mx.load(str(packed / "model.safetensors")), config)


@pytest.fixture(scope="module")
def fake_pair(tmp_path_factory) -> Path:
    """A stand-in pair laid out like the shipped one (random weights: fast to build)."""
    root = tmp_path_factory.mktemp("demo-pair")
    target = make_tiny_target(root / "target")
    make_tiny_drafter(root / "dspark", target, "dspark", block_size=4)
    make_tiny_drafter(root / "dflash", target, "dflash", block_size=4)
    return root


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_generate_without_model_uses_the_demo_pair(fake_pair, monkeypatch):
    monkeypatch.setenv("OUTRIDER_DEMO_DIR", str(fake_pair))
    result = invoke("generate", "--prompt", PROMPT, "--max-tokens", "12", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mode"] == find_pair("outrider-demo/target").mode and "demo pair" in result.stderr
    want = plain_greedy(fake_pair / "target", out["prompt_tokens"], 12)
    assert out["tokens"] == want
    dspark = invoke("generate", "--prompt", PROMPT, "-n", "12", "--mode", "dspark", "--json")
    assert dspark.exit_code == 0, dspark.output
    assert json.loads(dspark.stdout)["tokens"] == want
    dflash = invoke("generate", "--prompt", PROMPT, "-n", "12", "--mode", "dflash", "--json")
    assert dflash.exit_code == 0, dflash.output
    assert json.loads(dflash.stdout)["tokens"] == want
    rows = {r["id"]: r for r in json.loads(invoke("models", "--json").stdout)["pairs"]}
    assert rows["outrider-demo"]["target_local"] is True
    assert rows["outrider-demo"]["drafters"]["dspark"]["local"] is True


def test_the_shipped_pair_runs_losslessly_with_no_flags(monkeypatch):
    """The pair in the package (trained on the GPU machine): a fresh install's first command."""
    monkeypatch.delenv("OUTRIDER_DEMO_DIR", raising=False)
    shipped = Path(cli.__file__).parent / "demo" / "pair"
    sizes = sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file())
    assert sizes <= 16e6
    result = invoke("generate", "--prompt", "def fibonacci(", "-n", "24", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["tokens"] == plain_greedy(shipped / "target", out["prompt_tokens"], 24)
    for mode in ("dspark", "dflash"):
        res = invoke("generate", "--prompt", "def fibonacci(", "-n", "24", "--mode", mode, "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["tokens"] == out["tokens"], mode


def test_missing_demo_pair_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTRIDER_DEMO_DIR", str(tmp_path / "nowhere"))
    result = invoke("generate", "--prompt", PROMPT, "--max-tokens", "4")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the demo pair's target is missing")
    assert "make_demo_pair.py" in lines[0]


def test_registry_matches_the_demo_by_name_not_by_folder_name():
    assert find_pair("outrider-demo/target").id == "outrider-demo"
    assert find_pair("/some/where/target") is None
    assert SPECIAL_TOKENS[-1] == "<|mask|>"
