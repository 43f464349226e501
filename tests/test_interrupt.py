"""Ctrl-C keeps what was made: `generate` prints the partial result (`--json`: the object, with
finish reason "interrupted"; plain: the text and the summary line; on a terminal: the text, the
ribbon and the table) and exits 130; `train` exits 130 with one line saying where the last
checkpoint is.

Every test sends a real SIGINT. The quick ones raise it in-process at a chosen point of the
generation (after the n-th streamed chunk, or at a training event), so what is kept is exact;
the slow ones start the real command, wait for its output, then signal it.
"""

from __future__ import annotations

import io
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from outrider import api, cli, telemetry
from outrider.testing import make_tiny_drafter, make_tiny_target, make_toy_training_set
from outrider.train import progress

# however the suite was started, Ctrl-C reaches these tests (conftest.py)
pytestmark = pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("interrupt-models")
    target = make_tiny_target(root / "target")
    dspark = make_tiny_drafter(root / "dspark", target, kind="dspark", packaging="deepspec")
    return {"target": str(target), "dspark": str(dspark)}


def args(models, *extra: str) -> list[str]:
    return [
        "generate",
        *("--model", models["target"], "--drafter", models["dspark"], "--mode", "dspark"),
        *("--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), *extra),
    ]


@pytest.fixture(scope="module")
def full(models) -> dict:
    """The uninterrupted run, for comparison."""
    result = CliRunner().invoke(cli.app, args(models, "--json"))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["tokens"]) == MAX_TOKENS and len(out["rounds"]) >= 3
    return out


@pytest.fixture
def sigint_after(monkeypatch):
    """`sigint_after(n)`: a real SIGINT, raised as the n-th chunk of a generation is handed over
    (chunk 1 is the prefill's token, each later one a round)."""

    def arm(n: int) -> None:
        real = api.Pipeline.stream

        def stream(self, *args, **kwargs):
            for i, chunk in enumerate(real(self, *args, **kwargs), 1):
                if i == n:
                    signal.raise_signal(signal.SIGINT)  # the handler runs before this returns
                yield chunk

        monkeypatch.setattr(api.Pipeline, "stream", stream)

    return arm


def kept_rounds(full: dict, n_tokens: int) -> int:
    """How many of the full run's rounds the first n_tokens (after the prefill's) took."""
    total, rounds = 1, 0
    for r in full["rounds"]:
        if total >= n_tokens:
            break
        total += r["accepted"] + 1
        rounds += 1
    assert total == n_tokens
    return rounds


def test_json_ctrl_c_prints_the_partial_result(models, full, sigint_after):
    sigint_after(3)  # the prefill's token and two rounds, then Ctrl-C
    result = CliRunner().invoke(cli.app, args(models, "--json"))
    assert result.exit_code == 130, result.output
    out = json.loads(result.stdout)  # stdout is still exactly one JSON object
    assert out["finish_reason"] == "interrupted"
    assert 1 < len(out["tokens"]) < MAX_TOKENS
    assert out["tokens"] == full["tokens"][: len(out["tokens"])]  # what was kept is exact
    assert out["rounds"] == full["rounds"][:2]  # the two rounds run, no empty one for the stop
    assert kept_rounds(full, len(out["tokens"])) == 2
    assert out["text"] and full["text"].startswith(out["text"].rstrip("\ufffd"))
    assert out["prompt_tokens"] == full["prompt_tokens"] and out["decode_seconds"] > 0
    assert result.stderr.strip().splitlines()[-1] == "interrupted"


def test_plain_ctrl_c_prints_the_text_and_the_summary(models, full, sigint_after):
    sigint_after(3)
    result = CliRunner().invoke(cli.app, args(models))
    assert result.exit_code == 130, result.output
    *_, summary, last = result.stderr.strip().splitlines()
    assert last == "interrupted"
    n = int(summary.split(" tokens · ")[0])
    assert 1 < n < MAX_TOKENS and "decode" in summary and "mode dspark" in summary
    text = result.stdout.removesuffix("\n")
    assert text and full["text"].startswith(text.rstrip("\ufffd"))


def test_live_ctrl_c_keeps_the_text_and_the_table(models, full, sigint_after):
    pipe = api.load(models["target"], models["dspark"], "dspark")
    sigint_after(3)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80)
    result = telemetry.stream_live(pipe, PROMPT, {"max_tokens": MAX_TOKENS}, console)
    assert result is not None and result.finish_reason == "interrupted"
    assert result.tokens == full["tokens"][: len(result.tokens)] and len(result.rounds) == 2
    shown = buffer.getvalue()
    assert "interrupted" in shown and "mean accept length" in shown


def test_ctrl_c_before_generation_interrupts_as_before(models, monkeypatch):
    """Ctrl-C while the model loads: no handler of ours yet, one line, exit 130."""
    real = api.load

    def load(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)  # pragma: no cover (the signal stops it)

    monkeypatch.setattr(api, "load", load)
    result = CliRunner().invoke(cli.app, args(models, "--json"))
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == "interrupted"


def test_the_first_ctrl_c_asks_the_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with telemetry.CtrlC() as stop:
        assert not stop()
        signal.raise_signal(signal.SIGINT)
        assert stop()  # asked for, not raised
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the earlier handler is back
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `nohup`, `cmd &`: Ctrl-C is ignored
    try:
        with telemetry.CtrlC() as stop:
            signal.raise_signal(signal.SIGINT)
            assert not stop()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# --- train -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    return make_toy_training_set(tmp_path_factory.mktemp("interrupt-train"))


def train_args(toy, out: Path) -> list[str]:
    target, prompts = toy
    return [
        "train",
        *("--model", str(target), "--data", str(prompts), "--out", str(out)),
        *("--steps", "50", "--batch-size", "2", "--seq-len", "32", "--block-size", "4"),
        *("--max-new-tokens", "24", "--held-out", "1", "--eval-tokens", "4", "--log-every", "1"),
        *("--save-every", "2", "--no-compile", "--json"),
    ]


def sigint_at(monkeypatch, event: str, step: int | None = None) -> None:
    real = progress.JsonLines.__call__

    def call(self, e):
        real(self, e)
        if e["event"] == event and (step is None or e.get("step") == step):
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(progress.JsonLines, "__call__", call)


def test_train_ctrl_c_says_where_the_checkpoint_is(toy, tmp_path, monkeypatch):
    out = tmp_path / "run"
    sigint_at(monkeypatch, "step", 3)  # between steps 3 and 4; the last save was at step 2
    result = CliRunner().invoke(cli.app, train_args(toy, out))
    assert result.exit_code == 130, result.output
    saved = out / "checkpoints" / "step_0000003"  # saved at the last applied update
    line = result.stderr.strip()
    assert line == f"interrupted after step 3: checkpoint saved in {saved}; run again with --resume"
    assert (saved / "state.json").is_file()
    assert json.loads((saved / "state.json").read_text())["step"] == 3
    last = json.loads(result.stdout.splitlines()[-1])
    assert last == {"event": "interrupted", "checkpoint": str(saved)}


def test_train_ctrl_c_before_any_checkpoint(toy, tmp_path, monkeypatch):
    out = tmp_path / "early"
    sigint_at(monkeypatch, "data")  # the windows are ready, no step has run
    result = CliRunner().invoke(cli.app, train_args(toy, out))
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == (
        "interrupted before the first checkpoint; the training windows are kept: run again "
        "with --resume to train from step 0 without preparing the data again"
    )
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "event": "interrupted",
        "checkpoint": None,
    }


# --- the real command, a real Ctrl-C ------------------------------------------------------------


class Output:
    """Everything a file descriptor yields, read on a thread; `wait_for` blocks until a
    predicate holds (or fails after `timeout`), never a fixed sleep."""

    def __init__(self, fd: int) -> None:
        self.data = b""
        self.closed = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(fd,), daemon=True).start()

    def _read(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's master reads EIO once the child is gone
                chunk = b""
            with self._cond:
                if not chunk:
                    self.closed = True
                else:
                    self.data += chunk
                self._cond.notify_all()
            if not chunk:
                return

    def text(self) -> str:
        return self.data.decode(errors="replace")

    def wait_for(self, ready, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        with self._cond:
            while not ready(self.text()):
                left = end - time.monotonic()
                assert left > 0 and not self.closed, f"never came: {self.text()[-2000:]}"
                self._cond.wait(left)

    def wait_closed(self, timeout: float = 120) -> str:
        self.wait_for(lambda _: self.closed, timeout)
        return self.text()


def environment(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUTRIDER_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", OUTRIDER_CACHE=str(tmp_path / "cache"))
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT))
    return env


OUTRIDER = [str(Path(sys.executable).parent / "outrider")]
# The demo pair with no end-of-text in sight: `--raw "hi"` runs to --max-tokens.
LONG = ["generate", "--prompt", "hi", "--raw", "--max-tokens", "100000"]


def ctrl_c_reaches() -> None:
    """In the child before it runs: SIGINT as a terminal's foreground command has it. A suite
    started as a script's background job (`pytest &`, some CI runners) has SIGINT ignored, and
    an ignored signal stays ignored across exec, so no Ctrl-C would reach the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Output, Output]:
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(tmp_path),
        preexec_fn=ctrl_c_reaches,
    )
    return proc, Output(proc.stdout.fileno()), Output(proc.stderr.fileno())


@pytest.mark.slow
def test_real_ctrl_c_json(tmp_path):
    """`--json` prints nothing before the end, so a wrapper says when a round has run."""
    code = (
        "import sys\n"
        "from outrider import api\n"
        "real = api.Pipeline.stream\n"
        "def stream(*a, **k):\n"
        "    for i, c in enumerate(real(*a, **k)):\n"
        "        if i == 3: print('ready', file=sys.stderr, flush=True)\n"
        "        yield c\n"
        "api.Pipeline.stream = stream\n"
        f"sys.argv = ['outrider', *{LONG + ['--json']!r}]\n"
        "from outrider.__main__ import run\n"
        "run()\n"
    )
    proc, out, err = start([sys.executable, "-c", code], tmp_path)
    err.wait_for(lambda s: "ready\n" in s)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, err.wait_closed()
    result = json.loads(out.wait_closed())
    assert result["finish_reason"] == "interrupted" and len(result["tokens"]) >= 3
    assert result["text"] and result["mode"] == "dspark"
    assert err.wait_closed().strip().splitlines()[-1] == "interrupted"


@pytest.mark.slow
def test_real_ctrl_c_plain(tmp_path):
    proc, out, err = start(OUTRIDER + LONG, tmp_path)
    out.wait_for(lambda s: len(s) >= 20)  # text is streaming
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, err.wait_closed()
    text = out.wait_closed()
    *_, summary, last = err.wait_closed().strip().splitlines()
    assert last == "interrupted"
    assert int(summary.split(" tokens · ")[0]) >= 20 and "mode dspark" in summary
    assert len(text.rstrip("\n")) >= 20 and text.endswith("\n")


@pytest.mark.slow
def test_real_ctrl_c_on_a_terminal(tmp_path):
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(
        OUTRIDER + LONG,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=environment(tmp_path),
        preexec_fn=ctrl_c_reaches,
    )
    os.close(slave)
    screen = Output(master)
    try:
        screen.wait_for(lambda s: "tok/s" in s and "rounds" in s)  # the live panel is up
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, screen.text()[-2000:]
        shown = screen.wait_closed()
    finally:
        os.close(master)
    after = shown.rsplit("mean accept length", 1)  # the final table, after the live panel
    assert len(after) == 2 and "finish" in after[1] and "interrupted" in after[1]
    assert after[1].rstrip().endswith("interrupted")


@pytest.mark.slow
def test_real_ctrl_c_train(toy, tmp_path):
    out_dir = tmp_path / "run"
    cmd = OUTRIDER + train_args(toy, out_dir)
    cmd[cmd.index("--steps") + 1] = "100000"
    proc, out, err = start(cmd, tmp_path)
    out.wait_for(lambda s: '"event": "step"' in s)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, err.wait_closed()
    line = err.wait_closed().strip()
    assert line.startswith("interrupted after step ") and line.endswith("; run again with --resume")
    saved = Path(line.split("checkpoint saved in ")[1].split(";")[0])
    assert saved.parent == out_dir / "checkpoints" and (saved / "state.json").is_file()
    assert json.loads(out.wait_closed().splitlines()[-1])["checkpoint"] == str(saved)


@pytest.mark.slow
def test_serve_ctrl_c_after_a_request_exits_130(models):
    """Once a request has run on the engine's thread, a plain interpreter exit could abort in
    MLX's threads (SIGABRT, rc -6); serve must shut down and exit 130."""
    import socket

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "outrider", "serve", "-m", models["target"], "--mode", "lookup",
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches)
    try:
        for line in proc.stderr:  # wait for the server to say it listens (no fixed sleep)
            if "listening on" in line:
                break
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert requests.post(url, json=body, timeout=120).status_code == 200
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait() == 130, rest
        assert "interrupted" in rest and "terminate called" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
