"""`outrider train --resume` after an interruption: the self-distilled answers are kept chunk by
chunk as they come, a resume continues after the last whole chunk and ends with exactly the
windows of an uninterrupted run, answers made for other settings are never reused, and a run
resumed at its last step still reports its loss and its training time. Tiny fp32 models, CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import toy_train_config
from typer.testing import CliRunner

from outrider import cli
from outrider.core.errors import Interrupted, OutriderError
from outrider.train import TrainConfig, train_drafter
from outrider.train import data as D
from outrider.train.command import interrupted

# 19 prompts, 3 held out: 16 answered in 4 chunks of 4
CHUNK = 4


def config(toy, out: Path, **overrides) -> TrainConfig:
    settings = dict(
        steps=2,
        batch_size=4,
        eval_tokens=8,
        compile=False,
        distill_chunk=CHUNK,
        log_every=1,
    )
    return toy_train_config(toy, out, **{**settings, **overrides})


def interrupt_at(done: int):
    """An on_event that Ctrl-Cs once the target has answered `done` prompts."""

    def on_event(event):
        if event["event"] == "regenerate" and event["done"] == done:
            raise KeyboardInterrupt

    return on_event


def windows_of(out: Path) -> dict[str, np.ndarray]:
    arrays = mx.load(str(out / "checkpoints" / "windows.safetensors"))
    return {k: np.array(v) for k, v in arrays.items()}


@pytest.fixture(scope="session")  # kept across modules: built once a worker
def straight(toy):
    out = toy["root"] / "straight"
    events: list[dict] = []
    report = train_drafter(config(toy, out), on_event=events.append)
    return out, report, events


def test_interrupted_self_distillation_resumes_with_the_same_windows(toy, straight):
    out = toy["root"] / "resumed"
    with pytest.raises(Interrupted, match="--resume to continue the self-distillation") as e:
        train_drafter(config(toy, out), on_event=interrupt_at(2 * CHUNK))
    assert "answers to 8 prompts (2 chunks)" in str(e.value)
    kept = sorted(p.name for p in (out / "checkpoints" / "distill").glob("chunk_*"))
    assert kept == ["chunk_000000.safetensors", "chunk_000001.safetensors"]
    assert not (out / "checkpoints" / "windows.safetensors").exists()
    # what the CLI says for a Ctrl-C that reaches it from there (e.g. a second one)
    said = interrupted(config(toy, out), lambda event: None, KeyboardInterrupt())
    assert "2 chunks of answers are kept" in str(said) and "continue the self-distill" in str(said)

    events: list[dict] = []
    train_drafter(config(toy, out, resume=True), on_event=events.append)
    progress = [(e["done"], e["total"]) for e in events if e["event"] == "regenerate"]
    assert progress == [(8, 16), (12, 16), (16, 16)]  # starts at what was kept
    data = next(e for e in events if e["event"] == "data")
    assert not data["reused"] and data["answers_reused"] == 8
    a, b = windows_of(straight[0]), windows_of(out)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    straight_progress = [(e["done"], e["total"]) for e in straight[2] if e["event"] == "regenerate"]
    assert straight_progress == [(4, 16), (8, 16), (12, 16), (16, 16)]


def test_kept_answers_are_read_back_not_generated_again(toy, tmp_path):
    """The pieces under the trainer: a generate that is Ctrl-C'd in its third call, then a
    resume whose generate must only be asked for the chunks that were not kept."""
    from mlx_lm.utils import load

    _, tokenizer = load(str(toy["target"]))
    records = D.read_records([toy["prompts"]])[:10]
    calls: list[int] = []

    def generate(prompts, max_tokens=None):
        calls.append(len(prompts))
        if len(calls) == 3 and stop:
            raise KeyboardInterrupt
        return [[len(p) % 50, 7, len(calls)] for p in prompts]

    manifest = {"model": "toy", "max_new_tokens": 3}
    stop = True
    store = D.AnswerStore.open(tmp_path / "distill", manifest, resume=False)
    with pytest.raises(KeyboardInterrupt):
        D.build_sequences(records, tokenizer, D.Answers(generate, store), None, chunk=4)
    assert D.AnswerStore.kept_chunks(tmp_path / "distill") == 2
    stop, calls[:] = False, []
    seen: list[tuple[int, int]] = []
    store = D.AnswerStore.open(tmp_path / "distill", manifest, resume=True)
    ask = D.Answers(generate, store, lambda d, t: seen.append((d, t)))
    resumed = D.build_sequences(records, tokenizer, ask, None, chunk=4)
    assert calls == [2] and ask.reused == 8 and seen == [(8, 10), (10, 10)]
    # the kept chunks hold the first run's answers (its call numbers 1 and 2), the last is new
    assert [s.ids[-1] for s in resumed] == [1] * 4 + [2] * 4 + [1] * 2
    with pytest.raises(OutriderError, match="max_new_tokens was 3, now 4"):
        D.AnswerStore.open(tmp_path / "distill", {**manifest, "max_new_tokens": 4}, resume=True)


def test_a_resume_with_other_settings_does_not_reuse_the_answers(toy, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        train_drafter(config(toy, out), on_event=interrupt_at(CHUNK))
    distill = out / "checkpoints" / "distill"
    before = (distill / "chunk_000000.safetensors").read_bytes()
    with pytest.raises(OutriderError, match=r"max_new_tokens was 40, now 20.*delete"):
        train_drafter(config(toy, out, resume=True, max_new_tokens=20))
    other = tmp_path / "other.jsonl"
    other.write_text(toy["prompts"].read_text().replace("sun", "moon"))
    with pytest.raises(OutriderError, match="the training prompts differ"):
        train_drafter(config(toy, out, resume=True, data=[str(other)]))
    assert (distill / "chunk_000000.safetensors").read_bytes() == before  # left as it was
    # with the stale answers deleted (as the message says), the target answers again
    for p in distill.iterdir():
        p.unlink()
    distill.rmdir()
    events: list[dict] = []
    train_drafter(config(toy, out, resume=True, max_new_tokens=20, steps=1), events.append)
    progress = [e["done"] for e in events if e["event"] == "regenerate"]
    assert progress == [4, 8, 12, 16]
    assert json.loads((distill / "manifest.json").read_text())["max_new_tokens"] == 20


def test_the_windows_are_not_reused_for_other_settings(toy, straight, tmp_path):
    """Finished windows of other settings are not reused either: the answers' manifest decides
    (a resume with another --max-new-tokens is refused, not trained on the old windows)."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(straight[0], out)
    with pytest.raises(OutriderError, match="max_new_tokens was 40, now 30"):
        train_drafter(config(toy, out, resume=True, max_new_tokens=30))


def test_a_run_resumed_at_its_last_step_reports_its_loss_and_time(toy, straight):
    out, report, _ = straight
    state = json.loads((out / "checkpoints" / "step_0000002" / "state.json").read_text())
    assert state["loss"] == report.final_loss and state["seconds"] > 0
    assert state["tokens"] == 2 * 4 * 96
    # the process was killed after its last checkpoint, before the drafter was written
    (out / "model.safetensors").unlink()
    again = train_drafter(config(toy, out, resume=True))
    assert math.isfinite(again.final_loss) and again.final_loss == report.final_loss
    assert again.seconds == pytest.approx(state["seconds"], abs=1e-3) and again.seconds > 0
    assert again.tokens_per_second == pytest.approx(state["tokens"] / state["seconds"], rel=1e-3)
    saved = json.loads((out / "train_report.json").read_text())
    assert math.isfinite(saved["final_loss"]) and saved["seconds"] > 0


def test_seconds_and_tokens_add_up_across_resumes(toy, tmp_path):
    out = tmp_path / "run"

    def stop_after_step_1(event):
        if event["event"] == "step" and event["step"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="after step 1"):
        train_drafter(config(toy, out, steps=3), on_event=stop_after_step_1)
    first = json.loads((out / "checkpoints" / "step_0000001" / "state.json").read_text())
    assert first["tokens"] == 4 * 96 and first["seconds"] > 0 and math.isfinite(first["loss"])
    report = train_drafter(config(toy, out, steps=3, resume=True))
    last = json.loads((out / "checkpoints" / "step_0000003" / "state.json").read_text())
    assert last["tokens"] == 3 * 4 * 96 and last["seconds"] > first["seconds"]
    assert report.seconds >= last["seconds"] and report.final_loss == last["loss"]


def test_resume_help_says_what_it_reuses():
    result = CliRunner().invoke(cli.app, ["train", "--help"], terminal_width=200)
    shown = " ".join(result.output.replace("│", " ").split())
    assert "interrupted self-distillation" in shown and "--max-new-tokens" in shown


def test_sigterm_stops_a_background_run_with_a_checkpoint(toy, tmp_path):
    """`timeout`, `kill` and schedulers send SIGTERM; a script's background job has SIGINT
    ignored. Either way the run stops as Ctrl-C stops it: a checkpoint and how to resume."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [
        sys.executable, "-m", "outrider", "train", "--model", str(toy["target"]),
        "--data", str(toy["prompts"]), "--out", str(out), "--steps", "100000",
        "--batch-size", "4", "--seq-len", "96", "--block-size", "5", "--max-new-tokens", "40",
        "--held-out", "0", "--seed", "0", "--log-every", "1", "--json",
        "--no-compile",  # a fresh MLX kernel cache compiles the step for ~30 s: not the point
    ]  # fmt: skip
    # as bash starts a background job of a script: SIGINT ignored
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        env={**os.environ, "OUTRIDER_MATMUL": "native"},
    )
    for line in proc.stdout:
        if json.loads(line)["event"] == "step":
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "run again with --resume" in err
    assert list((out / "checkpoints").glob("step_*")), "a checkpoint at the last applied step"
