"""What the server says about itself while it runs: `/calibration` and `/doctor`, the rounds
log and its event stream, the settings it hands agents (`/admin/integrations`), slow-round
logging, the warm-up of a load, and `/health` warnings."""

from __future__ import annotations

import pytest
import requests
from live_server import live_server
from typer.testing import CliRunner

from outrider.cli import app
from outrider.server.generation import Limits
from outrider.testing import make_scripted_target

H = {"x-api-key": "adm1n"}  # ignored by a server started without a key


@pytest.fixture(scope="module")
def scripted(models_dir):
    return make_scripted_target(models_dir / "scripted-telemetry")


def chat(url: str, **extra) -> requests.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, headers=H)


def test_calibration_and_doctor_report_what_the_commands_do():
    """`GET /calibration`: the loaded pair's measured costs and what `auto` believes (or why
    there are none); `GET /doctor`: `outrider doctor --json`."""
    from outrider.demo import demo_target
    from outrider.server.engine import LoadSpec

    with live_server(LoadSpec(demo_target(), max_draft=2)) as (url, engine):
        got = requests.get(url + "/calibration").json()
        assert got["available"] is False and "not calibrated" in got["reason"]
        doctor = requests.get(url + "/doctor").json()
        assert doctor["outrider_version"] and isinstance(doctor["problems"], list)
        assert "dense" in doctor["target_families"]
    with live_server(None) as (url, engine):
        assert requests.get(url + "/calibration").json() == {
            "available": False,
            "reason": "no model is loaded",
        }


@pytest.mark.slow  # measures the demo pair's costs inline first (~15 s on 2 cores)
def test_calibration_shows_the_measured_curve_and_the_policy():
    from outrider.demo import demo_target
    from outrider.server.engine import LoadSpec

    with live_server(LoadSpec(demo_target(), max_draft="auto")) as (url, engine):
        requests.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 8},
        ).raise_for_status()
        got = requests.get(url + "/calibration").json()
        assert got["available"] and got["mode"] == "dspark" and got["max_draft"] == "auto"
        cal = got["calibration"]
        assert cal["key"]["mode"] == "dspark" and cal["verify_ms"] and cal["draft_ms"] > 0
        assert got["policy"] is not None  # a generation ran under `auto`


def test_rounds_and_events_show_each_round_as_it_runs():
    """`GET /rounds`: the engine's last rounds across requests and their totals; `GET /events`
    replays the last rounds, then streams each new one as its request runs, and a request's
    prefill progress (`event: prefill`) before its rounds."""
    import json

    from outrider.demo import demo_target
    from outrider.server.engine import LoadSpec

    def ask(url: str) -> int:
        body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 12}
        r = requests.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens"]

    with live_server(LoadSpec(demo_target(), max_draft=2), Limits(keepalive_s=0.2)) as (url, _):
        empty = requests.get(url + "/rounds").json()
        assert empty["rounds"] == [] and empty["stats"]["rounds"] == 0
        ask(url)
        first = requests.get(url + "/rounds").json()
        mine = [r for r in first["rounds"] if r["req"] == 1]
        assert mine and [r["i"] for r in mine] == list(range(len(mine)))
        assert mine[0]["source"] == "prefill" and {r["mode"] for r in mine} == {"dspark"}
        assert sum(r["committed"] for r in mine) == 12 == first["stats"]["tokens"]
        drafts = [r for r in mine if r["source"] == "draft"]
        assert drafts and all(0 <= r["accepted"] <= r["drafted"] <= 2 for r in drafts)
        assert requests.get(url + "/rounds?limit=2").json()["rounds"] == first["rounds"][-2:]
        assert requests.get(url + "/rounds?limit=-1").status_code == 400

        with requests.get(url + "/events", stream=True) as stream:
            frames = stream.iter_lines(decode_unicode=True)

            def next_event() -> tuple[str, dict]:
                kind = None
                for line in frames:
                    if line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        return kind, json.loads(line.removeprefix("data: "))
                raise AssertionError("the event stream ended")

            replay = []
            while (event := next_event())[0] == "round":
                replay.append(event[1])
            assert replay == first["rounds"][-32:] and event == ("stats", first["stats"])
            n_prompt = ask(url)  # while the stream is open
            live, prefilled = [], []
            second = [r for r in requests.get(url + "/rounds").json()["rounds"] if r["req"] == 2]
            while len(live) < len(second):
                kind, data = next_event()
                if kind == "round":
                    live.append(data)
                elif kind == "prefill":  # said before the request's first round
                    assert not live
                    prefilled.append(data)
            assert live == second
            # a long prompt's progress: the tokens of each evaluated prefill chunk so far, of
            # the whole prompt (the last token goes with the first round's forward)
            assert prefilled and {p["req"] for p in prefilled} == {2}
            assert 0 < prefilled[-1]["done"] < prefilled[-1]["total"] == n_prompt


def test_integrations_hand_agents_working_settings_and_never_the_key(tmp_path):
    """`GET /admin/integrations`: Claude Code, Codex, OpenCode, pi and any OpenAI-compatible
    app, each pointed at this server's URL and model; files parse as their formats; a server
    with an API key names a variable instead of the key."""
    import json

    from outrider.registry.validate import tomllib  # the standard library's, or tomli on 3.10

    target = make_scripted_target(tmp_path / "scripted")
    spec_args = dict(mode="lookup")
    from outrider.server.engine import LoadSpec

    with live_server(LoadSpec(str(target), **spec_args)) as (url, engine):
        got = requests.get(url + "/admin/integrations").json()
        model = requests.get(url + "/health").json()["model"]
        assert got["base_url"] == url and got["model"] == model
        by_id = {i["id"]: i for i in got["integrations"]}
        assert set(by_id) == {"claude-code", "codex", "opencode", "pi", "openai-compatible"}
        env = by_id["claude-code"]["setup"][1]["env"]
        assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_MODEL"] == model
        codex = tomllib.loads(by_id["codex"]["setup"][0]["content"])
        assert codex["model_providers"]["outrider"]["base_url"] == url + "/v1"
        assert codex["profiles"]["outrider"]["model"] == model
        opencode = json.loads(by_id["opencode"]["setup"][0]["content"])
        assert opencode["provider"]["outrider"]["options"]["baseURL"] == url + "/v1"
        pi = json.loads(by_id["pi"]["setup"][0]["content"])
        assert pi["providers"]["outrider"]["models"][0]["id"] == model
    with live_server(LoadSpec(str(target), **spec_args), api_key="sekret-key") as (url, engine):
        r = requests.get(url + "/admin/integrations", headers={"x-api-key": "sekret-key"})
        assert r.status_code == 200 and "sekret-key" not in r.text
        by_id = {i["id"]: i for i in r.json()["integrations"]}
        codex = tomllib.loads(by_id["codex"]["setup"][0]["content"])
        assert codex["model_providers"]["outrider"]["env_key"] == "OUTRIDER_API_KEY"
        assert requests.get(url + "/admin/integrations").status_code == 401
    with live_server(None) as (url, engine):
        assert requests.get(url + "/admin/integrations").status_code == 503


def test_a_slow_round_is_logged_and_a_bad_threshold_is_one_line(scripted, monkeypatch, caplog):
    """A round or plain step slower than $OUTRIDER_SLOW_ROUND_S (default 10 s) is logged with
    its request; prefill is not a round. A value that is not a number stops `serve` at once."""
    import logging

    from outrider.server.engine import LoadSpec
    from outrider.server.jobs import SLOW_ENV

    monkeypatch.setenv(SLOW_ENV, "1e-9")  # every step is slower than that
    with caplog.at_level(logging.WARNING, logger="outrider.slow"):
        with live_server(LoadSpec(str(scripted), mode="lookup")) as (url, _):
            assert chat(url, max_tokens=3).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "outrider.slow"]
    assert lines and all(line.startswith("request 1: a ") for line in lines)
    assert all(SLOW_ENV in line and " s (drafted " in line for line in lines)
    monkeypatch.setenv(SLOW_ENV, "0")  # off
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="outrider.slow"):
        with live_server(LoadSpec(str(scripted), mode="lookup")) as (url, _):
            assert chat(url, max_tokens=3).status_code == 200
    assert not [r for r in caplog.records if r.name == "outrider.slow"]
    monkeypatch.setenv(SLOW_ENV, "soon")
    result = CliRunner().invoke(app, ["serve", "--no-model", "--port", "1"])
    assert result.exit_code == 2 and f"{SLOW_ENV} must be a number" in result.output


def test_a_load_warms_its_pipeline_up_where_asked(scripted, monkeypatch, capfd):
    """`warmup` (serve --warmup, /admin/load's field): a throwaway generation before the
    model serves, by default only on a GPU (this CPU builds no kernels). It leaves nothing
    behind: no prefix-cache entry, no cap policy, no queueing gate, and the same output. One
    that fails costs a warning line, not the load."""
    from live_server import wait_ready

    from outrider import load
    from outrider.api import Pipeline
    from outrider.server.engine import Engine, LoadSpec

    pipe = load(str(scripted), mode="lookup")
    want = pipe.generate("hi", max_tokens=6).tokens
    pipe.enable_prefix_cache(0.1)
    assert pipe.warm_up() > 0
    assert pipe.prefix_cache.entries == 0 and pipe.cap_policy is None
    assert pipe.ahead_gate is None
    assert pipe.generate("hi", max_tokens=6).tokens == want
    warmed: list = []
    real = Pipeline.warm_up
    monkeypatch.setattr(Pipeline, "warm_up", lambda self: warmed.append(self) or real(self))
    engine = Engine().start()
    try:
        engine.load(LoadSpec(str(scripted), mode="lookup"))
        wait_ready(engine)
        assert warmed == []  # MLX's CPU backend: nothing to build
        engine.load(LoadSpec(str(scripted), mode="lookup", warmup=True))
        wait_ready(engine)
        assert warmed == [engine.pipeline] and engine.state == "ready"

        def broken(self):
            raise RuntimeError("no kernels today")

        monkeypatch.setattr(Pipeline, "warm_up", broken)
        engine.load(LoadSpec(str(scripted), mode="lookup", warmup=True))
        wait_ready(engine)
        assert engine.state == "ready" and engine.pipeline.generate("hi", max_tokens=6).tokens
        assert "up failed (no kernels today); serving anyway" in capfd.readouterr().err
        from outrider.server.warnings import collect

        (failed,) = [w for w in collect(engine) if w["code"] == "warm_up_failed"]
        assert "no kernels today" in failed["message"] and failed["level"] == "info"
        engine.load(LoadSpec(str(scripted), mode="lookup"))  # a new load forgets it
        wait_ready(engine)
        assert not [w for w in collect(engine) if w["code"] == "warm_up_failed"]
    finally:
        engine.stop()


def test_health_warnings_say_what_to_do():
    """Each condition /health warns about is one {code, level, message, action} entry."""
    from types import SimpleNamespace

    from outrider.core.prefix_cache import PrefixCache
    from outrider.server.metrics import Metrics
    from outrider.server.warnings import collect

    store = PrefixCache.from_gb(0.1)
    metrics = Metrics()
    engine = SimpleNamespace(
        warning=None, warm_up_error=None, pipeline=SimpleNamespace(notes=["fell back to lookup"]),
        prefix_cache=store, metrics=metrics,
    )  # fmt: skip
    assert collect(engine) == [
        {"code": "load_note", "level": "info", "message": "fell back to lookup", "action": None}
    ]
    store._disabled = "its recurrent state cannot be snapshotted"
    metrics.memory_shed()
    got = {w["code"]: w for w in collect(engine)}
    assert set(got) == {"load_note", "prefix_cache_off", "memory_shed"}
    assert "cannot be snapshotted" in got["prefix_cache_off"]["message"]
    assert (
        got["memory_shed"]["level"] == "warn"
        and "--prefix-cache-gb" in got["memory_shed"]["action"]
    )
