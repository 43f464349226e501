"""Operations: a model-less start, /admin load / unload / cancel, hot swaps and downloads,
health states, the `outrider claude` environment, and a bounded schema-driven fuzz run that
must find no 5xx. What a running server reports about itself is test_server_telemetry.py's."""

from __future__ import annotations

import json
import time

import pytest
import requests
from live_server import live_server, wait_ready
from typer.testing import CliRunner

from outrider.cli import app
from outrider.core import cuda_graphs
from outrider.core.device import on_cuda_gpu
from outrider.server.claude import claude_env, shell_exports
from outrider.server.generation import Limits
from outrider.testing import make_scripted_target

KEY = "adm1n"
H = {"x-api-key": KEY}


@pytest.fixture(scope="module")
def scripted(models_dir):
    return make_scripted_target(models_dir / "scripted-admin")


@pytest.fixture(scope="module")
def server():
    limits = Limits(default_max_tokens=4, max_tokens_cap=8, keepalive_s=5)
    with live_server(None, limits, api_key=KEY) as (url, engine):
        yield url, engine


def wait_health(url: str, until: str, timeout: float = 60) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        h = requests.get(url + "/health", headers=H).json()
        if h["status"] == until:
            return h
        time.sleep(0.05)
    raise AssertionError(f"health never became {until}: {h}")


def chat(url: str, **extra) -> requests.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, headers=H)


def test_no_model_then_load_unload_and_cancel(server, scripted):
    url, engine = server
    h = requests.get(url + "/health", headers=H).json()
    assert h["status"] == "no_model" and h["model"] is None
    r = chat(url)
    assert r.status_code == 503 and "POST /admin/load" in r.json()["error"]["message"]
    r = requests.post(url + "/v1/messages", json={"messages": [], "max_tokens": 1}, headers=H)
    assert r.status_code == 400  # validation comes first; the shape is Anthropic's
    assert r.json()["type"] == "error"
    bad_caps = ({"model": "x", "max_draft": -1}, {"model": "x", "max_draft": 65},
                {"model": "x", "max_draft": "fast"})  # fmt: skip
    bad_defaults = ({"model": "x", "reasoning_effort": "max"},
                    {"model": "x", "enable_thinking": "sometimes"},
                    {"model": "x", "lookup_long_draft": 0},
                    {"model": "x", "reasoning_budget": -1})  # fmt: skip
    for bad in ({}, {"model": ""}, *bad_caps, {"model": "x", "mode": "nope"}, *bad_defaults):
        assert requests.post(url + "/admin/load", json=bad, headers=H).status_code == 400
    assert requests.post(url + "/admin/load", json={"model": "x"}).status_code == 401
    assert requests.get(url + "/health", headers=H).json()["thinking_default"] == "template"
    # the thinking and effort defaults a load sets stay for the requests after it (sticky)
    body = {"model": str(scripted), "mode": "lookup", "max_draft": 3, "context_window": 300,
            "enable_thinking": False, "reasoning_effort": "low", "reasoning_budget": 64}  # fmt: skip
    r = requests.post(url + "/admin/load", json=body, headers=H)
    assert r.status_code == 202
    h = wait_health(url, "ok")
    assert h["model"] == "scripted-admin" and h["mode"] == "lookup" and h["max_draft"] == 3
    assert h["context_window"] == 300
    assert h["thinking_default"] == "off" and h["reasoning_effort_default"] == "low"
    assert h["reasoning_budget_default"] == 64
    assert h["capabilities"]["tools"] and h["capabilities"]["enable_thinking"]
    r = chat(url)
    assert r.status_code == 200 and r.json()["x_outrider"]["mode"] == "lookup"
    # What is not a model is refused before the running model is released, in one message
    # whether or not the path exists, and a long name is not echoed back.
    empty = scripted.parent / "empty-model"
    empty.mkdir(exist_ok=True)
    tail = (
        " is not a model folder (with config.json) or GGUF on this server, nor a Hugging Face "
        "repo id"
    )

    def refused(ref: str) -> str:
        r = requests.post(url + "/admin/load", json={"model": ref}, headers=H)
        assert r.status_code == 400, ref[:50]
        return r.json()["error"]["message"]

    for ref in (str(scripted) + "-missing", str(empty), "/etc", "a/" + "b" * 3000):
        msg = refused(ref)
        assert msg.startswith("model '") and msg.endswith(tail) and len(msg) < 200, msg
    assert (
        refused("x" * 10_000)
        == "invalid request: model: String should have at most 4096 characters"
    )
    # a folder that asks to run its own code: refused by name, the running model kept
    coded = make_scripted_target(scripted.parent / "coded")
    config = json.loads((coded / "config.json").read_text())
    (coded / "config.json").write_text(json.dumps({**config, "model_file": "mine.py"}))
    (coded / "mine.py").write_text("raise SystemExit('ran')\n")
    assert "never runs code from a checkpoint" in refused(str(coded))
    assert chat(url).status_code == 200
    # A load that fails later names the problem and brings the running model back.
    broken = scripted.parent / "broken-model"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text('{"model_type": "llama"}')
    r = requests.post(url + "/admin/load", json={"model": str(broken)}, headers=H)
    assert r.status_code == 202
    h = wait_health(url, "ok")
    assert h["model"] == "scripted-admin" and h["mode"] == "lookup"
    assert "could not load" in h["load"]["error"] and "still serving" in h["load"]["error"]
    assert h["context_window"] == 300
    assert chat(url).status_code == 200
    # A GGUF file is a model reference too (outrider.core.gguf), not refused up front.
    from outrider.testing import make_tiny_gguf

    gguf_file = make_tiny_gguf(scripted.parent / "tiny.gguf", family="llama", seed=3)
    r = requests.post(url + "/admin/load", json={"model": str(gguf_file)}, headers=H)
    assert r.status_code == 202
    h = wait_health(url, "ok")
    assert h["model"] == "tiny.gguf" and not h["load"]["error"], h
    assert chat(url).status_code == 200
    # Reload, then unload.
    requests.post(url + "/admin/load", json={"model": str(scripted), "mode": "baseline"}, headers=H)
    h = wait_health(url, "ok")
    assert h["mode"] == "baseline" and h["context_window"] == 300  # the window is sticky
    assert requests.post(url + "/admin/unload", headers=H).json() == {"unloading": True}
    wait_health(url, "no_model")
    assert chat(url).status_code == 503
    # Cancelling: a queued load is dropped, a running one discarded when it returns.
    assert requests.post(url + "/admin/load/cancel", headers=H).json()["cancelled"] is False
    nothing = requests.post(url + "/admin/load/cancel", json={"cleanup": True}, headers=H).json()
    assert nothing["cancelled"] is False and nothing["cleanup"] is False
    bad = requests.post(url + "/admin/load/cancel", json={"clean": True}, headers=H)
    assert bad.status_code == 400
    requests.post(url + "/admin/load", json={"model": str(scripted)}, headers=H)
    r = requests.post(url + "/admin/load/cancel", json={"cleanup": True}, headers=H).json()
    assert r["cancelled"] is True and r["cleanup"] is True and r["status"] == "no_model"
    time.sleep(0.5)
    assert requests.get(url + "/health", headers=H).json()["status"] == "no_model"


def test_claude_environment(server, scripted):
    url, _ = server
    requests.post(url + "/admin/load", json={"model": str(scripted), "mode": "lookup"}, headers=H)
    health = wait_health(url, "ok")
    base = {"ANTHROPIC_API_KEY": "real-key", "CLAUDE_CODE_USE_BEDROCK": "1", "HOME": "/home/u"}
    env = claude_env(base, url, KEY, health)
    assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_AUTH_TOKEN"] == KEY
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "scripted-admin"
    assert "ANTHROPIC_API_KEY" not in env and "CLAUDE_CODE_USE_BEDROCK" not in env
    assert env["HOME"] == "/home/u"
    text = shell_exports(env, base)
    assert "unset ANTHROPIC_API_KEY" in text and f"export ANTHROPIC_BASE_URL={url}" in text
    runner = CliRunner()
    out = runner.invoke(app, ["claude", "--url", url, "--api-key", KEY, "--print-env"])
    assert out.exit_code == 0, out.output
    assert "export ANTHROPIC_MODEL=scripted-admin" in out.output
    out = runner.invoke(app, ["claude", "--url", url, "--api-key", "wrong", "--print-env"])
    assert out.exit_code == 2 and "rejected the API key" in out.output
    out = runner.invoke(app, ["claude", "--url", "http://127.0.0.1:9", "--print-env"])
    assert out.exit_code == 2 and "no outrider server" in out.output


def test_claude_launches_the_child_with_its_environment(server, scripted, tmp_path):
    """A stand-in `claude` on PATH records what it was started with."""
    import json
    import os
    import subprocess
    import sys

    url, _ = server
    requests.post(url + "/admin/load", json={"model": str(scripted), "mode": "lookup"}, headers=H)
    wait_health(url, "ok")
    record = tmp_path / "record.json"
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
        "ANTHROPIC_API_KEY": "a-real-key",
        "HOME": str(home),
        # a CUDA driver keeps its kernel cache in ~/.nv unless told otherwise (MLX's CUDA build)
        "CUDA_CACHE_PATH": str(tmp_path / "cuda-cache"),
    }
    cmd = [sys.executable, "-m", "outrider", "claude", "--url", url, "--api-key", KEY]
    done = subprocess.run([*cmd, "--", "--resume", "-p", "hi"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["--resume", "-p", "hi"]
    assert seen["env"]["ANTHROPIC_BASE_URL"] == url
    assert seen["env"]["ANTHROPIC_MODEL"] == "scripted-admin"
    assert "ANTHROPIC_API_KEY" not in seen["env"]
    assert list(home.iterdir()) == []  # nothing written to the user's files


@pytest.mark.slow  # a fuzzing run: the full suite's
def test_schema_fuzz_finds_no_server_errors(server, scripted):
    """Schemathesis generates requests from the server's own OpenAPI document."""
    import schemathesis

    url, _ = server
    requests.post(url + "/admin/load", json={"model": str(scripted), "mode": "lookup"}, headers=H)
    wait_health(url, "ok")
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=H)
    ops = [r.ok() for r in schema.exclude(path_regex="^/admin").get_all_operations()]
    assert {o.label for o in ops} >= {"POST /v1/chat/completions", "POST /v1/messages"}
    seen = set()
    for op in ops:
        fuzz(op, url, seen)
    assert ("POST /v1/chat/completions", 4) in seen  # the fuzzer did reach refusals
    assert requests.get(url + "/health", headers=H).json()["status"] == "ok"


def fuzz(op, url: str, seen: set) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(
        max_examples=8,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def run(case):
        resp = case.call(base_url=url, headers=H)
        seen.add((op.label, resp.status_code // 100))
        assert resp.status_code < 500, f"{op.label} {case.body!r} -> {resp.text}"

    run()


def test_serve_flags_are_checked_before_loading():
    runner = CliRunner()
    for args, needle in (
        (["serve", "--port", "0"], "--port"),
        (["serve", "--context-window", "3"], "--context-window"),
        (["serve", "--no-model", "--model", "x"], "contradict"),
        (["serve", "--mode", "nope"], "nope"),
        (["serve", "--max-request-mb", "0"], "--max-request-mb"),
        (["serve", "--log-level", "loud"], "--log-level"),
        (["serve", "--cors-origin", "evil.example"], "--cors-origin"),
        (["serve", "--target", "a", "--model", "b"], "--target is another name for --model"),
        # mlx-dspark's --no-prefix-cache is a budget of 0, whatever --prefix-cache-gb says
        (["serve", "--no-prefix-cache", "--prefix-cache-gb", "-1", "--log-level", "x"], "--log"),
    ):
        out = runner.invoke(app, args)
        assert out.exit_code == 2 and needle in out.output, out.output


def test_a_failing_generation_is_reported_and_the_server_keeps_serving(scripted):
    """A generation that raises: 500 in each API's shape (or an in-stream error event), the
    engine thread lives on and the next request is served."""
    import dataclasses

    from outrider import load
    from outrider.api import Pipeline
    from outrider.server.engine import LoadSpec

    class Exploding(Pipeline):
        def stream(self, prompt, **kw):
            if kw.get("max_tokens") == 7:
                raise RuntimeError("boom")
            yield from super().stream(prompt, **kw)

    def loader(spec: LoadSpec) -> Pipeline:
        pipe = load(spec.model, mode=spec.mode)
        return Exploding(**{f.name: getattr(pipe, f.name) for f in dataclasses.fields(pipe)})

    with live_server(LoadSpec(str(scripted), mode="lookup"), loader=loader) as (url, engine):
        assert isinstance(engine.pipeline, Exploding)
        r = chat(url, max_tokens=7)
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "generation failed: RuntimeError: boom"
        body = {
            "model": "scripted-admin",
            "max_tokens": 7,
            "messages": [{"role": "user", "content": "x"}],
        }
        r = requests.post(url + "/v1/messages", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        with requests.post(url + "/v1/messages", json={**body, "stream": True}, stream=True) as r:
            frames = [f for f in r.iter_lines(decode_unicode=True) if f.startswith("event:")]
        assert frames[-1] == "event: error"
        ok = chat(url, max_tokens=3)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert "outrider_errors_total" in requests.get(url + "/metrics").text


def test_a_hot_swap_runs_as_serve_was_started(scripted):
    """`/admin/load` takes the server's flags (--kv-bits, --drafter-bits, --no-lookup-drafts,
    --drafter-window, --max-draft, --confidence-threshold) for what it does not name itself;
    what it names wins. They used to fall back to the library's defaults on every swap."""
    from outrider import load
    from outrider.server.engine import LoadSpec

    seen: list[LoadSpec] = []

    def loader(spec: LoadSpec):
        seen.append(spec)
        return load(spec.model, mode="lookup")

    flags = dict(kv_bits=8, drafter_bits=16, lookup_drafts=False, drafter_window=10,
                 max_draft=3, confidence_threshold=0.4)  # fmt: skip
    start = LoadSpec(str(scripted), mode="lookup", **flags)
    with live_server(start, loader=loader, load_settings=flags) as (url, engine):
        for body in (
            {"model": str(scripted)},
            {"model": str(scripted), "kv_bits": 4, "max_draft": "auto", "lookup_drafts": True,
             "drafter_bits": 8, "drafter_window": 0, "confidence_threshold": None},
        ):  # fmt: skip
            assert requests.post(url + "/admin/load", json=body).status_code == 202
            wait_ready(engine)
    swapped, named = seen[1], seen[2]
    assert {k: getattr(swapped, k) for k in flags} == flags
    assert (named.kv_bits, named.max_draft, named.lookup_drafts) == (4, "auto", True)
    assert (named.drafter_bits, named.drafter_window) == (8, 0)
    assert named.confidence_threshold == 0.4  # null names nothing: the flag's stands


def test_health_names_the_registry_drafter_in_use():
    """With no --drafter, the registry row's drafter is what runs, and /health says which."""
    from outrider.demo import demo_target
    from outrider.server.engine import LoadSpec

    with live_server(LoadSpec(demo_target())) as (url, engine):
        h = requests.get(url + "/health").json()
        assert h["mode"] == "dspark" and h["drafter"] == "outrider-demo/dspark"
        assert h["drafter_window"] == 4096  # context rows the drafter sees, by default
        assert h["confidence_threshold"] == 0.0  # DSpark's head, its stop off
        assert h["lookup_drafts"] is True and h["lookup_long_draft"] == 32
        assert requests.get(url + "/admin/status").json()["drafter"] == "outrider-demo/dspark"
        # MLX's CUDA graphs as this process runs them; nothing reads them off a CUDA GPU
        assert h["cuda_graphs"] == (cuda_graphs.state() if on_cuda_gpu() else None)
    spec = LoadSpec(demo_target(), confidence_threshold=0.3, lookup_long_draft=12)
    with live_server(spec) as (url, engine):
        h = requests.get(url + "/health").json()
        assert h["confidence_threshold"] == 0.3 and h["lookup_long_draft"] == 12
    with live_server(LoadSpec(demo_target(), mode="lookup")) as (url, engine):
        h = requests.get(url + "/health").json()
        assert h["drafter"] is None and h["drafter_window"] is None
        assert h["confidence_threshold"] is None and h["lookup_drafts"] is False


def test_serve_on_a_busy_port_is_one_line_before_listening():
    """It used to print "listening", load the model, then abort (SIGABRT) when uvicorn could not
    bind."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "outrider", "serve", "--no-model", "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another server is listening there)"
    )


def _until(check, timeout: float = 120.0):  # a hang guard, not a timing assertion
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.parametrize("cleanup", [False, True])
def test_a_cancelled_download_stops_and_the_running_model_keeps_serving(
    scripted, monkeypatch, tmp_path, cleanup
):
    """The download runs before the running model is released: /health shows its bytes and
    the fit warning, a cancel stops it at its next chunk, and the model that was serving is
    still loaded (never released, never loaded again). The stopped download's partial file
    stays for the next try to resume, unless the cancel asked for `cleanup`; finished files
    stay either way. huggingface_hub downloads nothing."""
    from types import SimpleNamespace

    from huggingface_hub import constants
    from live_server import wait_ready

    from outrider.core import fit, hub
    from outrider.server.admin import health
    from outrider.server.engine import Engine, LoadSpec, default_prefetch

    blobs = tmp_path / "models--someone--big" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.incomplete").write_bytes(b"half")
    (blobs / "def").write_bytes(b"whole")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    monkeypatch.setattr(fit, "download_warning", lambda repo, window=None: f"{repo}: {window}")
    seen = {"chunks": 0}

    def fetch(tqdm_class):  # a 1 GB file, 10 s at this pace
        bar = tqdm_class(desc="Reconstructing", total=10**9, unit="B")
        try:
            for _ in range(2000):
                bar.update(5 * 10**5)
                seen["chunks"] += 1
                time.sleep(0.005)
        except hub.DownloadCancelled:
            seen["stopped"] = True
            raise
        return "/nonexistent"

    def prefetch(spec):
        if spec.model == "someone/big":
            hub.fetch_with_progress(spec.model, "model", fetch)
        else:
            default_prefetch(spec)

    engine = Engine(prefetch=prefetch).start()
    try:
        engine.load(LoadSpec(str(scripted), mode="lookup", context_window=300))
        wait_ready(engine)
        serving = engine.pipeline
        engine.load(LoadSpec("someone/big"))
        state = SimpleNamespace(engine=engine, limits=Limits())
        h = _until(lambda: (h := health(state))["load"].get("download", {}).get("bytes_done") and h)
        assert h["status"] == "loading" and h["load"]["phase"] == "downloading"
        download = h["load"]["download"]
        assert download["repo"] == "someone/big" and download["bytes_total"] == 10**9
        assert 0 < download["bytes_done"] < 10**9 and 0 < download["fraction"] < 1
        assert h["load"]["warning"] == "someone/big: 300"  # the fit check saw the window
        assert [w["code"] for w in h["warnings"]] == ["kv_may_not_fit"]
        assert h["warnings"][0]["message"] == "someone/big: 300" and h["warnings"][0]["action"]
        assert engine.cancel_load(cleanup=cleanup) is True and engine.cancel_load() is False
        h = health(state)
        assert h["status"] == "ok" and h["model"] == "scripted-admin" and h["mode"] == "lookup"
        assert "download" not in h["load"] and h["context_window"] == 300
        assert h["load"]["error"] == (
            f"loading someone/big was cancelled; still serving {scripted}"
        )
        _until(lambda: seen.get("stopped"))
        assert seen["chunks"] < 2000 and engine.pipeline is serving
        time.sleep(0.2)  # the worker has wound the load up: nothing changed
        assert engine.state == "ready" and engine.pipeline is serving and engine.download is None
        assert (blobs / "abc.incomplete").exists() is not cleanup and (blobs / "def").exists()
    finally:
        engine.stop()


def test_a_cancel_after_the_download_loads_the_previous_model_again(scripted):
    """Past the download the running model is gone; a cancel then brings it back."""
    import threading

    from live_server import wait_ready

    from outrider.server.engine import Engine, LoadSpec, default_loader

    gate = threading.Event()
    entered = threading.Event()

    def loader(spec):
        if spec.mode == "baseline":
            entered.set()
            gate.wait(10)
        return default_loader(spec)

    engine = Engine(loader, prefetch=lambda spec: None).start()
    try:
        engine.load(LoadSpec(str(scripted), mode="lookup"))
        wait_ready(engine)
        engine.load(LoadSpec(str(scripted), mode="baseline"))
        assert entered.wait(10)
        assert engine.cancel_load() is True
        assert engine.state == "loading" and engine.phase == "cancelling"
        gate.set()
        wait_ready(engine)
        assert engine.state == "ready" and engine.pipeline.mode == "lookup"
        assert (
            engine.error.startswith("loading ") and "was cancelled; still serving" in engine.error
        )
    finally:
        gate.set()
        engine.stop()
