"""The web page in a real headless Chromium (selenium + the system's chromium and chromedriver)
against a live server with an API key over scripted targets: the page loads and asks for the
key, a wrong key is refused, a chat answer streams (reasoning folded, telemetry, tool calls),
the race shows two identical texts and a speed-up, and the model picker switches models.

A screenshot of each view is written to a temporary folder, and copied to the folder named by
OUTRIDER_SCREENSHOTS (e.g. docs/images) when that is set. Skips, saying why, where chromium,
chromedriver or selenium are missing (`.ci/run` installs them)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import requests
from live_server import live_server, sse_frames

from outrider.registry import load_pairs
from outrider.server.engine import LoadSpec
from outrider.server.generation import Limits
from outrider.testing import SCRIPT, make_scripted_target

KEY = "web-key"
H = {"x-api-key": KEY}
WAIT_S = 60  # a hang guard, not a timing assertion
WORDS = (
    "Outrider| drafts| several| tokens| ahead,| then| the| target| model| checks| every| guess"
    "| in| one| forward| pass| and| keeps| exactly| what| it| would| have| written| anyway:"
    "| same| answer,| shorter| wait.| Plain| decoding| spends| another| full| step| on| each"
    "| word| instead."
).split("|")
ANSWER = "".join(WORDS)
# Model A answers every chat with a think block, then ANSWER; a prompt that contains ANSWER lets
# lookup drafting guess it. Model B (the default script) answers "The answer is 42.".
SCRIPT_A = [["<|cue_chat|>", "<think>", "Thinking it over.", "</think>", *WORDS, "<|im_end|>"]]
SCRIPT_A += SCRIPT[1:]
TOOLS = (
    '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",'
    ' "properties": {"city": {"type": "string"}}}}}]'
)


def _browser() -> tuple[str, str]:
    """Paths of chromium and chromedriver, or a skip that says what is missing."""
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    names = ("chromium", "chromium-browser", "google-chrome")
    chromium = next((p for p in map(shutil.which, names) if p), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing = " and ".join(
            n for n, p in (("chromium", chromium), ("chromedriver", driver)) if not p
        )
        pytest.skip(f"{missing} not found (apt-get install chromium chromium-driver)")
    return chromium, driver


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    """A keyed server over model A; model B sits in an LM Studio folder under a temporary HOME,
    where the picker finds it."""
    home = tmp_path_factory.mktemp("home")
    a = make_scripted_target(models_dir / "web-a", SCRIPT_A)
    make_scripted_target(home / ".lmstudio" / "models" / "outrider-test" / "scripted-b")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        spec = LoadSpec(str(a), mode="lookup")
        with live_server(spec, Limits(keepalive_s=5), api_key=KEY) as (url, engine):
            yield url, engine


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    chromium, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # selenium must never fetch a driver
        drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    drv.set_page_load_timeout(WAIT_S)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Saves a screenshot; copies it to $OUTRIDER_SCREENSHOTS when set."""
    folder = tmp_path_factory.mktemp("screenshots")
    target = os.environ.get("OUTRIDER_SCREENSHOTS")

    def save(drv, name: str) -> Path:
        path = folder / f"{name}.png"
        assert drv.save_screenshot(str(path)), f"no screenshot for {name}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(target) / path.name)
        return path

    return save


def wait(drv, condition, message: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, WAIT_S, poll_frequency=0.05).until(condition, message)


def by_id(drv, id_: str):
    from selenium.webdriver.common.by import By

    return drv.find_element(By.ID, id_)


def text_is(id_: str, expected: str):
    return lambda d: by_id(d, id_).text == expected


def open_page(drv, url: str, key: str | None) -> None:
    """A fresh load of the page with `key` stored (or none), settled on its first /health."""
    drv.get(url + "/")
    if key is None:
        drv.execute_script("localStorage.clear()")
    else:
        drv.execute_script("localStorage.setItem('outrider.apiKey', arguments[0])", key)
    drv.refresh()
    wait(
        drv,
        lambda d: by_id(d, "server-status").get_attribute("data-status") != "unknown",
        "the page never heard back from /health",
    )


def send_chat(drv, text: str):
    """Send a chat message; the assistant's answer element once it is done."""
    from selenium.webdriver.common.by import By

    before = len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = by_id(drv, "chat-input")
    box.clear()
    box.send_keys(text)
    by_id(drv, "chat-send").click()
    wait(
        drv,
        lambda d: (
            len(answers := d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before
            and answers[-1].get_attribute("data-done") == "yes"
        ),
        "the answer never finished",
    )
    answer = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert not answer.get_attribute("data-error"), answer.get_attribute("data-error")
    return answer


def page_errors(drv) -> list[dict]:
    """Script errors and blocked content (CSP) the console saw since the last call; refused
    requests (401 before the key is entered) are the network's and expected."""
    return [
        e for e in drv.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"
    ]


def _events(frames: list[str]) -> list[tuple[str, dict]]:
    out = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if not line.startswith(":"))
        if "data" in lines:
            out.append((lines.get("event", "message"), json.loads(lines["data"])))
    return out


def test_the_chat_stream_reports_tokens_and_rounds_per_frame(server):
    url, _ = server
    body = {
        "messages": [{"role": "user", "content": "Repeat after me: " + ANSWER}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(url + "/v1/chat/completions", json=body, headers=H, stream=True) as r:
        chunks = [json.loads(f[6:]) for f in sse_frames(r) if f.startswith("data: {")]
    reports = [c["x_outrider"] for c in chunks if "x_outrider" in c]
    final = next(
        c["x_outrider"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    )
    usage = chunks[-1]["usage"]
    assert sum(x.get("tokens", 0) for x in reports) == usage["completion_tokens"] == len(WORDS) + 3
    ribbon = [pair for x in reports for pair in x.get("ribbon", [])]
    assert 0 < len(ribbon) <= final["rounds"]
    assert [6, 6] in ribbon  # lookup found the answer in the prompt: a full draft kept
    assert all(0 <= a <= d for d, a in ribbon if d) and all(a == 0 for d, a in ribbon if not d)


def test_the_race_streams_both_arms_and_its_verdict(server):
    url, _ = server
    body = {"prompt": "Repeat after me: " + ANSWER, "max_tokens": 100}
    with requests.post(url + "/admin/race", json=body, headers=H, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(sse_frames(r))
    kinds = [k for k, _ in events if k != "token"]
    assert kinds == ["start", "arm_start", "arm_done", "arm_start", "arm_done", "verdict", "done"]
    start, verdict = events[0][1], events[-2][1]
    assert start["mode"] == "lookup" and start["max_tokens"] == 100
    tokens = {
        arm: [d for k, d in events if k == "token" and d["arm"] == arm] for arm in ("plain", "spec")
    }
    done = {d["arm"]: d for k, d in events if k == "arm_done"}
    expected = "<think>Thinking it over.</think>" + ANSWER
    for arm, toks in tokens.items():
        assert "".join(t["text"] for t in toks) == expected
        assert [t["t_ms"] for t in toks] == sorted(t["t_ms"] for t in toks) and toks[0]["t_ms"] == 0
        assert toks[-1]["index"] == done[arm]["tokens"] == len(WORDS) + 3
    assert not any("round" in t for t in tokens["plain"]) and done["plain"]["rounds"] == 0
    spec_rounds = [t["round"] for t in tokens["spec"] if "round" in t]
    assert len(spec_rounds) == done["spec"]["rounds"] > 0  # race frames are never merged
    assert done["spec"]["accept_len"] > 1 and done["plain"]["accept_len"] == 1
    assert verdict["identical"] is True and verdict["first_difference"] is None
    ratio = done["spec"]["tokens_per_sec"] / done["plain"]["tokens_per_sec"]
    assert verdict["speedup"] == pytest.approx(ratio, rel=0.01)


def test_a_race_of_caps_runs_each_arm_and_compares_it_with_the_first(server):
    """`caps`: 2 to 4 arms of the loaded pipeline (0: plain decoding; "auto": measured), each
    checked against the first; the plain arm drafts nothing, the others draft."""
    url, _ = server
    body = {"prompt": "Repeat after me: " + ANSWER, "max_tokens": 40, "caps": [0, 2, "auto"]}
    with requests.post(url + "/admin/race", json=body, headers=H, stream=True) as r:
        events = _events(sse_frames(r))
    kinds = [k for k, _ in events if k != "token"]
    assert kinds == ["start"] + ["arm_start", "arm_done"] * 3 + ["verdict", "done"]
    assert events[0][1]["arms"] == ["plain", "cap 2", "auto"]
    starts = [d for k, d in events if k == "arm_start"]
    assert [d["max_draft"] for d in starts] == [0, 2, "auto"]
    done = {d["arm"]: d for k, d in events if k == "arm_done"}
    assert done["plain"]["rounds"] == 0 and done["cap 2"]["rounds"] > 0
    assert done["cap 2"]["accept_len"] <= 3  # at most 2 drafts kept a round
    verdict = events[-2][1]
    assert [a["arm"] for a in verdict["arms"]] == ["cap 2", "auto"]
    assert verdict["identical"] and all(a["identical"] for a in verdict["arms"])
    assert verdict["speedup"] == verdict["arms"][-1]["speedup"]


def test_a_race_of_modes_builds_each_over_the_loaded_target(server):
    """`arms`: 2 to 4 modes over the loaded target, baseline's and lookup's built for the race
    (baseline's is `--mode baseline`'s own pipelined loop, not the loaded pipeline at cap 0),
    each at its own cap or one given, and each checked against the first."""
    url, _ = server
    arms = ["baseline", "lookup", {"mode": "lookup", "cap": 2}]
    body = {"prompt": "Repeat after me: " + ANSWER, "max_tokens": 40, "arms": arms}
    with requests.post(url + "/admin/race", json=body, headers=H, stream=True) as r:
        assert r.status_code == 200
        events = _events(sse_frames(r))
    kinds = [k for k, _ in events if k != "token"]
    assert kinds == ["start"] + ["arm_start", "arm_done"] * 3 + ["verdict", "done"]
    assert events[0][1]["arms"] == ["baseline", "lookup", "lookup cap 2"]
    starts = [d for k, d in events if k == "arm_start"]
    assert [d["mode"] for d in starts] == ["baseline", "lookup", "lookup"]
    assert starts[0]["max_draft"] == 0 and starts[2]["max_draft"] == 2
    done = {d["arm"]: d for k, d in events if k == "arm_done"}
    assert done["baseline"]["rounds"] == 0 and done["lookup"]["rounds"] > 0
    assert done["lookup"]["accept_len"] > 3 >= done["lookup cap 2"]["accept_len"] > 1
    verdict = events[-2][1]
    assert verdict["identical"] and all(a["identical"] for a in verdict["arms"])
    health = requests.get(url + "/health", headers=H).json()
    assert health["mode"] == "lookup"  # the loaded pipeline is untouched


def test_a_divergence_is_weighed_by_the_targets_own_margin(server):
    """Where arms part, one plain step from a fresh prefill reads the target's top
    alternatives: the best token leads the arm's by a margin (0 would be a tie), and the
    runner-up is named as such; a token outside the top is a lower bound."""
    from types import SimpleNamespace

    from outrider.server.race import _margin, margin_of

    url, engine = server
    assert margin_of([(5, -0.1), (7, -2.6)], 7) == {"margin": 2.5, "runner_up": True}
    assert margin_of([(5, -0.1), (7, -2.6)], 9) == {
        "margin": 2.5, "at_least": True, "runner_up": False,
    }  # fmt: skip
    prompt = engine.pipeline.encode("hi")
    greedy = engine.pipeline.generate(prompt, max_tokens=1).tokens[0]
    state = SimpleNamespace(engine=engine)
    opts = {"max_tokens": 4, "temperature": 0.0}
    best = asyncio.run(_margin(state, prompt, opts, greedy))
    assert best == {"margin": 0.0, "runner_up": False, "approximate": True}
    other = asyncio.run(_margin(state, prompt, opts, (greedy + 1) % 100))
    assert other["approximate"] and other["margin"] > 0


def test_a_race_renders_with_the_thinking_it_is_given(server):
    """`thinking` (the reference project's name) and `enable_thinking` turn the template's
    thinking off alike: the prompt closes an empty think block, so it is longer; a
    `reasoning_effort` reaches the template too (this one writes it into a system block)."""
    url, _ = server

    def prompt_tokens(**extra) -> int:
        body = {"prompt": "hi", "max_tokens": 2, "caps": [0, 2], **extra}
        with requests.post(url + "/admin/race", json=body, headers=H, stream=True) as r:
            assert r.status_code == 200
            return _events(sse_frames(r))[0][1]["prompt_tokens"]

    default = prompt_tokens()
    off = prompt_tokens(thinking=False)
    assert off > default and prompt_tokens(enable_thinking=False) == off
    assert prompt_tokens(thinking=False, enable_thinking=False, reasoning_effort="low") > off


def test_race_requests_are_checked(server):
    url, _ = server
    for bad in (
        {}, {"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "n": 2},
        {"prompt": "x", "caps": [0]}, {"prompt": "x", "caps": [0, 1, 2, 3, 4]},
        {"prompt": "x", "caps": [-1, 2]}, {"prompt": "x", "caps": [2, 2]},
        {"prompt": "x", "caps": ["fast", 2]},
        {"prompt": "x", "arms": ["lookup"]}, {"prompt": "x", "arms": ["lookup", "lookup"]},
        {"prompt": "x", "arms": ["baseline", {"mode": "lookup", "cap": 65}]},
        {"prompt": "x", "arms": [{"mode": "baseline", "cap": 2}, "lookup"]},
        {"prompt": "x", "arms": ["baseline", {"mode": "lookup", "speed": 2}]},
        {"prompt": "x", "arms": ["baseline", "lookup"], "caps": [0, 2]},
        {"prompt": "x", "arms": ["baseline", "dspark"]},
        {"prompt": "x", "arms": ["baseline", {"mode": "baseline", "cap": "auto"}]},
        {"prompt": "x", "arms": ["baseline", {"mode": "lookup", "confidence": 1.5}]},
        {"prompt": "x", "arms": ["baseline", {"mode": "lookup", "confidence": 0.5}]},
        {"prompt": "x", "thinking": True, "enable_thinking": False},
        {"prompt": "x", "reasoning_effort": "max"},
    ):  # fmt: skip
        r = requests.post(url + "/admin/race", json=bad, headers=H)
        assert r.status_code == 400, bad
    r = requests.post(url + "/admin/race", json={"prompt": "x", "max_tokens": 10**9}, headers=H)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = requests.post(url + "/admin/race", json={"prompt": "x", "arms": ["lookup", "dspark"]},
                      headers=H)  # fmt: skip
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "'dspark'" in message and "baseline, lookup" in message


def test_the_model_list(server):
    url, _ = server
    listed = requests.get(url + "/admin/models", headers=H).json()
    assert listed["loaded"]["model"] == "web-a" and listed["loaded"]["mode"] == "lookup"
    assert {"auto", "lookup", "baseline"} <= set(listed["modes"])
    assert [r["id"] for r in listed["registry"]] == [p.id for p in load_pairs()]
    demo = next(r for r in listed["registry"] if r["id"] == "outrider-demo")  # ships installed
    assert demo["local"] and demo["drafters_local"] == {"dspark": True, "dflash": True}
    assert 0 < demo["size_gb"] < 0.1 and demo["fits"] is True
    assert all({"size_gb", "fits"} <= set(r) for r in listed["registry"])
    b = [m for m in listed["local"] if m["name"] == "outrider-test/scripted-b"]
    assert len(b) == 1 and b[0]["source"] == "LM Studio" and Path(b[0]["ref"]).is_dir()


def test_the_page_and_its_files_need_no_key_but_the_api_does(server):
    url, _ = server
    page = requests.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for src in re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text):
        assert requests.get(url + src).status_code == 200, src
    assert requests.head(url + "/").status_code == 200
    assert requests.get(url + "/health").status_code == 401
    assert requests.post(url + "/admin/race", json={"prompt": "x"}).status_code == 401
    assert requests.get(url + "/admin/models").status_code == 401


@pytest.mark.slow
def test_page_loads_asks_for_the_key_and_refuses_a_wrong_one(server, browser):
    url, _ = server
    open_page(browser, url, None)
    assert browser.title == "outrider"
    assert by_id(browser, "key-panel").is_displayed()
    assert "needs an API key" in by_id(browser, "key-message").text
    assert not by_id(browser, "key-error").is_displayed()
    assert by_id(browser, "model-name").text == "API key needed"
    by_id(browser, "key-input").send_keys("not-the-key")
    by_id(browser, "key-save").click()
    wait(browser, lambda d: by_id(d, "key-error").is_displayed(), "no wrong-key message")
    assert "Wrong API key" in by_id(browser, "key-error").text
    assert by_id(browser, "model-name").text == "API key needed"
    assert by_id(browser, "key-panel").is_displayed()
    by_id(browser, "key-input").send_keys(KEY)
    by_id(browser, "key-save").click()
    wait(browser, text_is("model-name", "web-a"), "the right key did not unlock the page")
    assert not by_id(browser, "key-panel").is_displayed()
    assert by_id(browser, "model-mode").text == "lookup · max_draft 6"
    assert not page_errors(browser)


@pytest.mark.slow
def test_a_chat_answer_streams_with_folded_reasoning_telemetry_and_tool_calls(
    server, browser, shots
):
    from selenium.webdriver.common.by import By

    url, _ = server
    open_page(browser, url, KEY)
    answer = send_chat(browser, "Repeat after me: " + ANSWER)
    assert answer.find_element(By.CSS_SELECTOR, ".content").text == ANSWER.strip()
    assert int(answer.get_attribute("data-frames")) > 1  # it arrived in pieces
    assert answer.get_attribute("data-finish") == "stop"
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None  # folded
    assert reasoning.get_attribute("textContent").endswith("Thinking it over.")
    stats = answer.find_element(By.CSS_SELECTOR, ".stats")
    assert stats.get_attribute("data-final") == "yes"
    assert re.search(
        rf"^{len(WORDS) + 3} tokens · [\d.]+ tok/s · accept [\d.]+ · \d+ rounds", stats.text
    )
    blocks = answer.find_elements(By.CSS_SELECTOR, ".ribbon .blk")
    assert blocks and answer.find_elements(By.CSS_SELECTOR, ".ribbon .blk.c4")  # fully kept drafts

    browser.find_element(By.CSS_SELECTOR, "#chat-options summary").click()
    by_id(browser, "opt-tools").send_keys(TOOLS)
    call = send_chat(browser, "What is the weather in Paris?")
    assert call.get_attribute("data-finish") == "tool_calls"
    assert call.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    assert '"city": "Paris"' in call.find_element(By.CSS_SELECTOR, ".tool-args").text
    browser.find_element(By.CSS_SELECTOR, "#chat-options summary").click()  # fold the options
    shots(browser, "web-chat")
    assert not page_errors(browser)

    # a thinking budget of 0: the server closes the thinking in the model's place
    browser.find_element(By.CSS_SELECTOR, "#chat-options summary").click()
    by_id(browser, "opt-tools").clear()
    by_id(browser, "opt-budget").send_keys("0")
    cut = send_chat(browser, "Think it over.")
    reasoning = cut.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("textContent").strip().endswith("I have to answer now.")
    assert "thinking closed by the budget" in cut.find_element(By.CSS_SELECTOR, ".stats").text
    by_id(browser, "opt-budget").clear()
    browser.find_element(By.CSS_SELECTOR, "#chat-options summary").click()
    assert not page_errors(browser)


def run_race(browser, never_ended: str) -> None:
    """Press Race and wait until the verdict is in (`never_ended`: the failure's words)."""
    by_id(browser, "race-run").click()
    wait(
        browser,
        lambda d: by_id(d, "race-verdict").get_attribute("data-state") not in ("idle", "running"),
        never_ended,
    )


@pytest.mark.slow
def test_the_race_shows_two_identical_texts_and_a_speedup(server, browser, shots):
    url, _ = server
    open_page(browser, url, KEY)
    by_id(browser, "tab-race").click()
    prompt = by_id(browser, "race-prompt")
    prompt.clear()
    prompt.send_keys("Repeat after me: " + ANSWER)
    run_race(browser, "the race never ended")
    verdict = by_id(browser, "race-verdict")
    assert verdict.get_attribute("data-state") == "identical", verdict.text
    assert "identical" in verdict.text
    expected = "<think>Thinking it over.</think>" + ANSWER
    assert by_id(browser, "race-spec-text").text == expected
    # the plain arm replays at its recorded pace beside the speculative one, then ends equal
    wait(browser, text_is("race-plain-text", expected), "the plain arm's text never completed")
    assert re.fullmatch(r"\d+\.\d\d×", by_id(browser, "race-speedup").text)
    assert "accept" in by_id(browser, "race-spec-stats").text
    assert "lookup · max_draft 6" in by_id(browser, "race-spec-note").text
    shots(browser, "web-race")
    assert not page_errors(browser)

    # against `--mode baseline`'s own loop instead of the loaded pipeline drafting nothing
    from selenium.webdriver.support.ui import Select

    Select(by_id(browser, "race-against")).select_by_value("baseline")
    run_race(browser, "the race against baseline never ended")
    assert by_id(browser, "race-verdict").get_attribute("data-state") == "identical"
    wait(browser, text_is("race-plain-text", expected), "the baseline arm's text never completed")
    assert by_id(browser, "race-plain-note").text == "baseline · max_draft 0"
    assert by_id(browser, "race-plain-title").text == "plain decoding"
    assert "accept" in by_id(browser, "race-spec-stats").text
    assert "accept" not in by_id(browser, "race-plain-stats").text
    assert not page_errors(browser)

    # the speculative arm at a cap of its own, against the loaded pipeline drafting nothing
    Select(by_id(browser, "race-against")).select_by_value("")
    by_id(browser, "race-cap").send_keys("2")
    run_race(browser, "the race at cap 2 never ended")
    assert by_id(browser, "race-verdict").get_attribute("data-state") == "identical"
    assert by_id(browser, "race-spec-note").text == "lookup · max_draft 2"
    assert by_id(browser, "race-plain-note").text == "lookup · max_draft 0"
    assert by_id(browser, "race-plain-title").text == "plain decoding"
    assert not page_errors(browser)


@pytest.mark.slow
def test_the_model_picker_lists_models_and_switches(server, browser, shots):
    from selenium.webdriver.common.by import By

    url, engine = server
    model_a = requests.get(url + "/admin/models", headers=H).json()["loaded"]["ref"]
    open_page(browser, url, KEY)
    by_id(browser, "tab-models").click()
    local = "#models-local button[data-ref$='outrider-test/scripted-b']"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, local), "model B is not listed")
    registry = by_id(browser, "models-registry").text
    assert all(p.id in registry for p in load_pairs())
    assert "web-a" in by_id(browser, "model-current").text
    browser.find_element(By.CSS_SELECTOR, local).click()
    wait(browser, text_is("model-name", "scripted-b"), "the header never showed model B")
    wait(
        browser,
        lambda d: "scripted-b" in by_id(d, "model-current").text,
        "the picker never showed model B as loaded",
    )
    assert not by_id(browser, "load-error").is_displayed()
    shots(browser, "web-models")
    assert engine.pipeline is not None and Path(engine.pipeline.target.name).name == "scripted-b"
    by_id(browser, "tab-chat").click()
    answer = send_chat(browser, "Hello")
    assert answer.find_element(By.CSS_SELECTOR, ".content").text == "The answer is 42."
    assert not page_errors(browser)
    # back to model A, so the module's other tests see it whatever order they run in
    requests.post(url + "/admin/load", json={"model": model_a, "mode": "lookup"}, headers=H)
    wait(browser, lambda d: engine.state == "ready", "model A did not load again")
    assert Path(engine.pipeline.target.name).name == "web-a"
