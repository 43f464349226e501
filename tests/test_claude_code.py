"""The real Claude Code CLI through `outrider claude -- -p … --output-format json` against a
scripted target whose answer is a tool call (Claude Code's Write) and, once the tool result
comes back, a final text: Claude Code must run the tool and finish cleanly, the server must
refuse none of its requests, and nothing may leave the machine but requests to the server.

Claude Code comes from npm into the checkout's .claude-code folder (`.ci/run` installs it
there); these tests skip only where npm is absent, so nothing could have installed it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from live_server import live_server

from outrider.server.claude import LOCAL_ONLY, claude_env, shell_exports
from outrider.server.engine import LoadSpec
from outrider.testing import make_scripted_target

CHECKOUT = Path(__file__).resolve().parents[1]
INSTALL = CHECKOUT / ".claude-code" / "node_modules" / ".bin"
INSTALL_HINT = "npm install --prefix .claude-code @anthropic-ai/claude-code"
HANG_GUARD_S = 600  # a hung Claude Code fails the test instead of stalling the run
MAX_TURNS = "4"  # the tool call and the answer take 2: a model calling tools forever fails fast

CONTENT = "hello from outrider"
FINAL = "The file is written."
PROMPT = "Create hello.txt saying hello."
SMALL_WINDOW = 32768  # the first case: a short system prompt and one tool
LARGE_WINDOW = 262144  # the second: Claude Code's default prompt and tools, byte-level tokens


def test_claude_env_keeps_claude_code_on_the_local_server(monkeypatch):
    """No telemetry, error reports, auto-updates or other traffic to Anthropic: set in the
    child's environment and printed by --print-env."""
    from typer.testing import CliRunner

    import outrider.server.claude as claude_mod
    from outrider.cli import app

    base = {"HOME": "/home/u", "DISABLE_TELEMETRY": "1"}
    env = claude_env(base, "http://127.0.0.1:8080", None, {"model": "m"})
    for key in (
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_TELEMETRY",
        "DISABLE_ERROR_REPORTING",
        "DISABLE_AUTOUPDATER",
    ):
        assert env[key] == "1"
    text = shell_exports(env, base).splitlines()
    for key in LOCAL_ONLY.keys() - base.keys():
        assert f"export {key}=1" in text
    assert "export DISABLE_TELEMETRY=1" not in text  # already so: no line for it
    monkeypatch.setattr(claude_mod, "probe", lambda url, key: {"model": "m"})
    for key in LOCAL_ONLY:
        monkeypatch.delenv(key, raising=False)
    out = CliRunner().invoke(app, ["claude", "--print-env"])
    assert out.exit_code == 0, out.output
    for key in LOCAL_ONLY:
        assert f"export {key}=1" in out.output.splitlines()


def test_claude_env_names_every_alias_and_compacts_a_long_window(monkeypatch):
    """Every model alias Claude Code may pick (Fable too) shows the served model, with a name
    and a description; the other providers' switches are dropped; a window of 100k tokens or
    more sets the auto-compact window to 80% of it (Claude Code clamps smaller ones);
    --print-settings prints the same as a settings file's `env` block."""
    import json

    from typer.testing import CliRunner

    import outrider.server.claude as claude_mod
    from outrider.cli import app

    base = {"CLAUDE_CODE_USE_MANTLE": "1", "CLAUDE_CODE_USE_ANTHROPIC_AWS": "1", "HOME": "/h"}
    health = {"model": "m", "mode": "dspark", "context_window": 131072}
    env = claude_env(base, "http://127.0.0.1:8080", None, health)
    for alias in ("OPUS", "SONNET", "HAIKU", "FABLE"):
        assert env[f"ANTHROPIC_DEFAULT_{alias}_MODEL"] == "m"
        assert env[f"ANTHROPIC_DEFAULT_{alias}_MODEL_NAME"] == "m"
        assert env[f"ANTHROPIC_DEFAULT_{alias}_MODEL_DESCRIPTION"] == "m on outrider (dspark)"
    assert "CLAUDE_CODE_USE_MANTLE" not in env and "CLAUDE_CODE_USE_ANTHROPIC_AWS" not in env
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(int(131072 * 0.8))
    small = claude_env(base, "http://x", None, {**health, "context_window": 32768})
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in small
    monkeypatch.setattr(claude_mod, "probe", lambda url, key: health)
    out = CliRunner().invoke(app, ["claude", "--print-settings"])
    assert out.exit_code == 0, out.output
    block = json.loads(out.output)["env"]
    assert block["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    assert block["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(int(131072 * 0.8))
    both = CliRunner().invoke(app, ["claude", "--print-settings", "--print-env"])
    assert both.exit_code != 0 and "pass one of them" in both.output


def test_late_system_entries_stay_before_the_reply():
    """Claude Code puts `system` entries after a user turn or a tool result; they stay there
    (appended to it), not after later turns, so a tool result still ends the prompt."""
    from outrider.chat.render import normalize
    from outrider.server.anthropic_api import CountRequest, to_chat

    call = {"type": "tool_use", "id": "t1", "name": "Write", "input": {"file_path": "/x"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}
    body = CountRequest.model_validate(
        {
            "system": "Top.",
            "messages": [
                {"role": "user", "content": "Write it."},
                {"role": "system", "content": "Agents: none."},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
                {"role": "system", "content": [{"type": "text", "text": "Tasks: none."}]},
            ],
        }
    )
    chat = normalize(to_chat(body))
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool"]
    assert chat[1]["content"] == "Write it.\n<system-reminder>Agents: none.</system-reminder>"
    assert chat[3]["content"] == "done\n<system-reminder>Tasks: none.</system-reminder>"


# -- the real Claude Code ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude_bin() -> Path:
    """The folder holding `claude`: the checkout's npm install, else `claude` on PATH."""
    if (INSTALL / "claude").exists():
        return INSTALL
    found = shutil.which("claude")
    if found:
        return Path(found).parent
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed, so Claude Code cannot be (`{INSTALL_HINT}`)")
    pytest.fail(f"Claude Code is not installed: run `{INSTALL_HINT}` in the checkout")


class ProxyRecorder:
    """A stand-in HTTP(S) proxy: whatever Claude Code sends anywhere but the local server
    (NO_PROXY) arrives here, is recorded (its request line) and refused."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._take_one()
        while self._take_one():  # connections made before stopping are still waiting
            pass

    def _take_one(self) -> bool:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return False
        with conn:
            conn.settimeout(2)
            try:
                head = conn.recv(4096)
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                head = b""
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            self.seen.append(line or "(a connection without a request)")
        return True

    def close(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        return self.seen


@contextmanager
def scripted_server(work: Path, window: int) -> Iterator[str]:
    """A live server whose target answers a Write of work/hello.txt, then FINAL after the
    tool result. One attention head of width 8 (its output is zeroed anyway: the answers are
    the same) keeps prefilling tens of thousands of byte tokens quick on a CPU."""
    call = {
        "name": "Write",
        "arguments": {"file_path": str(work / "hello.txt"), "content": CONTENT},
    }
    script = [
        ["<|cue_tools|>", "<tool_call>", json.dumps(call), "</tool_call>", "<|im_end|>"],
        ["<|cue_result|>", FINAL, "<|im_end|>"],
        ["<|cue_chat|>", "No tools offered.", "<|im_end|>"],
        ["<|cue_direct|>", "No tools offered.", "<|im_end|>"],
    ]
    path = make_scripted_target(
        work.parent / "target", script, heads=1, head_dim=8, max_positions=window
    )
    with live_server(LoadSpec(str(path), mode="lookup")) as (url, engine):
        assert engine.context_window == window
        yield url


def run_claude(
    claude_bin: Path, url: str, work: Path, proxy: str, args: list[str]
) -> subprocess.CompletedProcess[str]:
    """`outrider claude --url URL -- ARGS` in `work`, with a fresh HOME (nothing read from or
    written to the real one) and every proxy variable pointing at the recorder."""
    home = work.parent / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        PATH=os.pathsep.join([str(claude_bin), env.get("PATH", "")]),
    )
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = proxy
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    outrider = Path(sys.executable).with_name("outrider")
    cmd = [str(outrider)] if outrider.exists() else [sys.executable, "-m", "outrider"]
    cmd += ["claude", "--url", url, "--", *args, "--max-turns", MAX_TURNS]
    return subprocess.run(
        cmd, cwd=work, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def request_counts(url: str) -> dict[tuple[str, int], float]:
    """(route, status) -> requests, from the server's /metrics."""
    text = requests.get(url + "/metrics", timeout=10).text
    counts = {}
    for route, status, n in re.findall(
        r'^outrider_requests_total\{[^}]*route="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M
    ):
        counts[(route, int(status))] = float(n)
    return counts


def prompt_tokens(url: str) -> float:
    """Prompt tokens the server has processed, from its /metrics."""
    text = requests.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^outrider_prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)[1])


def check_session(
    proc: subprocess.CompletedProcess[str], work: Path, url: str, proxy: ProxyRecorder, caplog
) -> None:
    """Exit 0, a successful JSON result with the answer given after the tool result, the file
    the tool wrote, every request served (no 4xx or 5xx), and no traffic elsewhere."""
    access = "\n".join(r.getMessage() for r in caplog.records if r.name == "outrider.access")
    said = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}\naccess:\n{access}"
    assert proc.returncode == 0, said
    result = json.loads(proc.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", said
    assert result["result"] == FINAL, said
    assert result["permission_denials"] == [], said
    assert (work / "hello.txt").read_text() == CONTENT
    counts = request_counts(url)
    refused = {k: n for k, n in counts.items() if k[1] >= 400}
    assert not refused, f"refused: {refused}\n{said}"
    logged = [line for line in access.splitlines() if re.search(r'" [45]\d\d ', line)]
    assert access and not logged, f"the server's access log has 4xx/5xx: {logged}\n{said}"
    assert counts.get(("/v1/messages", 200), 0) >= 2, f"{counts}\n{said}"  # call, then answer
    assert proxy.close() == [], said


@pytest.fixture
def session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[tuple[Path, ProxyRecorder]]:
    """(work dir, proxy recorder), the access log captured for failure messages."""
    caplog.set_level(logging.INFO, logger="outrider.access")
    work = tmp_path / "work"
    work.mkdir()
    proxy = ProxyRecorder()
    yield work, proxy
    proxy.close()


@pytest.mark.slow
def test_claude_code_runs_a_tool_call(claude_bin, session, caplog):
    """A short system prompt and only the Write tool: the tool round trip itself."""
    work, proxy = session
    with scripted_server(work, SMALL_WINDOW) as url:
        args = ["-p", PROMPT, "--output-format", "json", "--system-prompt", "You write files."]
        args += ["--tools", "Write", "--allowedTools", "Write"]
        proc = run_claude(claude_bin, url, work, proxy.url, args)
        check_session(proc, work, url, proxy, caplog)


@pytest.mark.slow
def test_claude_code_with_its_default_prompt_and_tools(claude_bin, session, caplog):
    """Claude Code's own system prompt and full tool set (tens of thousands of byte tokens,
    mid-conversation system entries) on a target with room for them."""
    work, proxy = session
    with scripted_server(work, LARGE_WINDOW) as url:
        args = ["-p", PROMPT, "--output-format", "json", "--allowedTools", "Write"]
        proc = run_claude(claude_bin, url, work, proxy.url, args)
        check_session(proc, work, url, proxy, caplog)
        served = request_counts(url)[("/v1/messages", 200)]
        assert prompt_tokens(url) / served > SMALL_WINDOW  # more than the first case had room for
