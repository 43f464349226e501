"""The server against hostile and odd input: every case is refused with a 400-class answer in
its API's shape (or served, where that is the right answer), memory stays bounded, and the
server goes on serving afterwards."""

from __future__ import annotations

import json
import logging
import resource
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest
import requests
from live_server import live_server, thread_stacks

from outrider.server.engine import LoadSpec, default_loader
from outrider.server.generation import Limits
from outrider.testing import make_scripted_target

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "scripted-hostile"
WINDOW = 4096  # the tiny config's own max_position_embeddings
LIMIT = 1 << 20  # the body limit these servers run with: 1 MiB


@pytest.fixture(scope="module")
def scripted(models_dir):
    return make_scripted_target(models_dir / "scripted-hostile")


@pytest.fixture(scope="module")
def server(scripted):
    spec = LoadSpec(str(scripted), mode="lookup", context_window=WINDOW)
    with live_server(spec, Limits(keepalive_s=5, max_body_bytes=LIMIT)) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def trusting(scripted):
    """A second server that lets requests bring their own chat template."""
    spec = LoadSpec(str(scripted), mode="lookup", context_window=WINDOW)
    limits = Limits(keepalive_s=5, trust_request_chat_template=True)
    with live_server(spec, limits) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def still_serves(url: str) -> None:
    body = {"messages": ASK, "max_tokens": 8, "enable_thinking": False}
    r = requests.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == (
        "The answer is 42."
    )


def post_raw(url: str, path: str, raw: bytes, **headers: str) -> requests.Response:
    return requests.post(
        url + path, data=raw, headers={"content-type": "application/json", **headers}
    )


class PeakRss:
    """This process's peak resident memory while the block runs (Linux: the high-water mark is
    reset first through /proc/self/clear_refs, so an earlier peak cannot hide this one)."""

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = self._hwm()
        except OSError:  # pragma: no cover - not Linux
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.peak = self._hwm()
        except OSError:  # pragma: no cover
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.growth_mb = (self.peak - self.base) / 1024

    @staticmethod
    def _hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise OSError("no VmHWM")


# -- 1. Claude Code's mid-conversation system messages ------------------------------------------


def test_system_entries_inside_anthropic_messages_are_folded(claude):
    turn = [{"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "Well?"}]
    with_system = ASK + [turn[0], {"role": "system", "content": "Be brief."}, turn[1]]
    msg = claude.messages.create(model=MODEL, max_tokens=50, messages=with_system)
    assert msg.content[-1].text == "The answer is 42." and msg.stop_reason == "end_turn"
    plain = claude.messages.count_tokens(model=MODEL, messages=ASK + turn)
    folded = claude.messages.count_tokens(model=MODEL, messages=with_system)
    reminder = "<system-reminder>Be brief.</system-reminder>\n"
    assert folded.input_tokens == plain.input_tokens + len(reminder.encode())
    block = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    blocks = claude.messages.count_tokens(model=MODEL, messages=ASK + turn[:1] + block + turn[1:])
    assert blocks.input_tokens == folded.input_tokens


# -- 2. request-supplied chat templates ---------------------------------------------------------

BOMB = "{% for i in range(99999) %}{% for j in range(99999) %}{{ i }}{% endfor %}{% endfor %}"


def test_request_templates_are_refused_unless_the_server_trusts_them(server):
    url, _ = server
    for extra in ({"chat_template": BOMB}, {"chat_template_kwargs": {"chat_template": BOMB}}):
        with PeakRss() as rss:
            r = requests.post(
                url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}
            )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
        assert rss.growth_mb < 100
    still_serves(url)


def test_trusted_templates_render_in_the_sandbox_with_limits(trusting):
    url, _ = trusting
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|cue_direct|>"
    r = requests.post(
        url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "chat_template": own}
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "The answer is 42."
    assert r.json()["usage"]["prompt_tokens"] == len(ASK[0]["content"].encode()) + 1
    doubling = (
        '{% set ns = namespace(s="xx") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}'
        "{% endfor %}{{ ns.s }}"
    )
    for template in (BOMB, '{{ "x" * 10**10 }}', doubling, "{{ raise_exception('no') }}", "{%"):
        with PeakRss() as rss:
            r = requests.post(
                url + "/v1/chat/completions",
                json={"messages": ASK, "max_tokens": 4, "chat_template": template},
            )
        assert r.status_code == 400, template
        assert r.json()["error"]["param"] == "chat_template"
        assert rss.growth_mb < 100, template
    still_serves(url)


def test_the_sandbox_stops_a_template_that_only_burns_time():
    from outrider.chat.template_sandbox import TemplateRefused, render_untrusted

    spin = '{% for c in "x" * 99999 %}{% for d in "x" * 99999 %}{% endfor %}{% endfor %}'
    with pytest.raises(TemplateRefused, match="ran longer than 1 s"):
        render_untrusted(spin, {"messages": []}, timeout_s=1)
    assert render_untrusted("{{ messages | tojson }}", {"messages": [1]}) == "[1]"


# -- 3. request size -----------------------------------------------------------------------------


def test_bodies_over_the_limit_are_refused_before_they_are_read(server):
    url, _ = server
    big = {"messages": [{"role": "user", "content": "w" * (10 << 20)}], "max_tokens": 4}
    raw = json.dumps(big).encode()
    with PeakRss() as rss:
        r = post_raw(url, "/v1/chat/completions", raw)
        a = post_raw(url, "/v1/messages", raw)
        # No Content-Length: a chunked body is cut off once it passes the limit.
        chunked = requests.post(
            url + "/v1/completions",
            data=(raw[i : i + 65536] for i in range(0, len(raw), 65536)),
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert a.status_code == 413 and a.json()["error"]["type"] == "request_too_large"
    assert a.json()["type"] == "error"  # Anthropic's shape
    assert chunked.status_code == 413
    assert rss.growth_mb < 60
    still_serves(url)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server, claude):
    url, engine = server
    longest = max(map(len, engine.pipeline.tokenizer.get_vocab()))
    text = "w" * (WINDOW * longest + 10)  # within the body limit, beyond the window
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}]
        )
    message = e.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(f"> {WINDOW} maximum")
    r = requests.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    still_serves(url)


def test_the_length_bound_never_calls_the_tokenizer():
    from outrider.chat.render import PromptTooLong, encode_within

    class Spy:
        calls = 0

        def get_vocab(self) -> dict:
            return {"a": 0, "abcd": 1}

        def encode(self, text: str, **kw: object) -> list[int]:
            Spy.calls += 1
            return [0] * len(text)

    spy = Spy()
    with pytest.raises(PromptTooLong) as e:
        encode_within(spy, "a" * 41, window=10)  # 41 characters need at least 11 tokens
    assert e.value.tokens == 11 and Spy.calls == 0
    assert len(encode_within(spy, "a" * 40, window=10)) == 40 and Spy.calls == 1


# -- 4. cross-origin pages, remote admin, failed loads -------------------------------------------


def test_web_pages_cannot_drive_the_server(server, scripted):
    url, engine = server
    evil = {"Origin": "http://evil.example"}
    pre = requests.options(
        url + "/admin/load",
        headers={**evil, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in {k.lower() for k in pre.headers}
    for path, body in (("/admin/load", {"model": "/etc"}), ("/admin/unload", None)):
        r = requests.post(url + path, json=body, headers=evil)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin"
    r = requests.post(url + "/v1/messages", json={"messages": ASK, "max_tokens": 4}, headers=evil)
    assert r.status_code == 403 and r.json()["type"] == "error"
    same = {"Origin": url}  # the server's own pages
    r = requests.post(
        url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4}, headers=same
    )
    assert r.status_code == 200
    assert engine.state == "ready"
    still_serves(url)


def test_an_allowed_origin_gets_cors(scripted):
    spec = LoadSpec(str(scripted), mode="lookup")
    ok = "http://localhost:3000"
    with live_server(spec, cors_origins=(ok,)) as (url, _):
        pre = requests.options(
            url + "/v1/chat/completions",
            headers={"Origin": ok, "Access-Control-Request-Method": "POST"},
        )
        assert pre.headers.get("access-control-allow-origin") == ok
        r = requests.post(
            url + "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 4},
            headers={"Origin": ok},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ok
        other = requests.post(url + "/admin/unload", headers={"Origin": "http://localhost:3001"})
        assert other.status_code == 403


def test_admin_answers_only_local_clients_without_a_key():
    from fastapi.testclient import TestClient

    from outrider.server.app import create_app
    from outrider.server.engine import Engine

    engine = Engine()  # never started: these requests need no model
    remote = TestClient(create_app(engine), client=("203.0.113.7", 5000))
    r = remote.get("/admin/status")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_local_only"
    for path in ("/doctor", "/calibration"):  # this machine's paths
        assert remote.get(path).json()["error"]["code"] == "admin_local_only"
    assert remote.get("/health").status_code == 200  # the rest is not admin
    assert remote.get("/rounds").status_code == 200
    local = TestClient(create_app(engine), client=("127.0.0.1", 5000))
    assert local.get("/admin/status").status_code == 200
    keyed = TestClient(create_app(engine, api_key="k"), client=("203.0.113.7", 5000))
    assert keyed.get("/admin/status", headers={"x-api-key": "k"}).status_code == 200
    assert keyed.head("/").status_code == 200  # Claude Code's probe needs no key
    assert keyed.get("/health").status_code == 401


# -- 5. what used to be 500s ---------------------------------------------------------------------


def test_lone_surrogates_are_400s_on_every_text_route(server):
    url, _ = server
    lone = b'"a\\ud800b"'
    bodies = {
        "/v1/chat/completions": b'{"messages":[{"role":"user","content":%s}],"max_tokens":3}',
        "/v1/completions": b'{"prompt":%s,"max_tokens":3}',
        "/v1/messages": b'{"messages":[{"role":"user","content":%s}],"max_tokens":3}',
        "/v1/messages/count_tokens": b'{"messages":[{"role":"user","content":%s}]}',
        "/admin/load": b'{"model":%s}',
    }
    for path, template in bodies.items():
        r = post_raw(url, path, template % lone)
        assert r.status_code == 400, (path, r.text)
        assert "lone UTF-16 surrogate" in r.text
    r = post_raw(url, "/v1/chat/completions", b'{"messages":[{"role":"user","\\udc00":"x"}]}')
    assert r.status_code == 400
    still_serves(url)


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
@pytest.mark.parametrize("stream", [False, True])
def test_seeds_the_sampler_cannot_take_are_400s(server, seed, stream):
    url, _ = server
    body = {"messages": ASK, "max_tokens": 3, "temperature": 1.0, "seed": seed, "stream": stream}
    r = requests.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    ok = requests.post(url + "/v1/chat/completions", json={**body, "seed": 2**64 - 1})
    assert ok.status_code == 200


# -- 6. a client that leaves during prefill -----------------------------------------------------


def test_a_client_that_leaves_during_prefill_stops_it_within_one_chunk(scripted):
    """The first prefill chunk waits at a gate until the client has gone and the server has
    noticed; then only that chunk may have run, and the next request is served."""
    from outrider.core.target import PREFILL_CHUNK

    gate = {"entered": threading.Event(), "release": threading.Event(), "calls": 0}

    def gated_loader(spec: LoadSpec):
        pipe = default_loader(spec)
        run = pipe.target._run

        def counted(*args, **kwargs):
            gate["calls"] += 1
            if not gate["release"].is_set():
                gate["entered"].set()
                gate["release"].wait(120)
            return run(*args, **kwargs)

        pipe.target._run = counted  # this instance only, for this test
        return pipe

    spec = LoadSpec(str(scripted), mode="lookup", context_window=WINDOW)
    with live_server(spec, loader=gated_loader) as (url, engine):
        prompt = "w" * (4 * PREFILL_CHUNK + 100)  # five chunks of prefill
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True}
        response = requests.post(url + "/v1/messages", json=body, stream=True)
        # kept until the client leaves on purpose: a line iterator dropped after one line
        # closes the connection, which a loaded machine could notice before the prefill began
        lines = response.iter_lines()
        assert next(lines).startswith(b"event: message_start")
        entered = gate["entered"].wait(120)  # a hang guard, not a timing assertion
        # this has failed now and then under a loaded -n auto run, with the engine idle: say
        # what the request became (cancelled early? answered without a prefill chunk?)
        assert entered, (
            f"state {engine.state}, queue {engine._jobs.qsize()}, cancelled "
            f"{engine.metrics.cancelled}, prefill chunks {gate['calls']}, the rest of the "
            f"stream {response.raw.read(2000)!r}\n{thread_stacks()}"
        )
        job = engine._current
        lines.close()
        response.close()  # the client goes away mid-prefill
        deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
        while not job.cancel.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert job.cancel.is_set()
        gate["release"].set()
        while engine.metrics.cancelled < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.metrics.cancelled == 1
        assert gate["calls"] == 1  # the rest of the prompt was never computed
        still_serves(url)


# -- 7. smaller gaps ---------------------------------------------------------------------------


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
PDF = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"},
}
SEEN = "this model reads text only and cannot see it]"


def test_what_the_model_cannot_see_becomes_a_line_saying_so():
    """An image (or a PDF, audio, a file) in a conversation is not refused: the model reads a
    line saying what was there, and the conversation goes on. A text document or a search
    result is text the model can read."""
    from outrider.chat.render import normalize
    from outrider.server.anthropic_api import CountRequest, to_chat

    text_doc = {
        "type": "document",
        "title": "notes.txt",
        "source": {"type": "text", "media_type": "text/plain", "data": "buy milk"},
    }
    found = {
        "type": "search_result",
        "title": "Tides",
        "source": "https://example.org/t",
        "content": [{"type": "text", "text": "Two a day."}],
    }
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "read screenshot.png:"}, IMAGE],
    }
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "s.png"}}
    body = CountRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "look: "}, IMAGE, PDF]},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, text_doc, found]},
    ])  # fmt: skip
    chat = to_chat(body)
    assert chat[0]["content"] == (
        "look: [an image was attached here; " + SEEN + "[a document was attached here; " + SEEN
    )
    assert chat[2] == {
        "role": "tool", "tool_call_id": "t1",
        "content": "read screenshot.png:[an image was attached here; " + SEEN,
    }  # fmt: skip
    assert chat[3]["content"] == "notes.txt\nbuy milkTides - https://example.org/t\nTwo a day."
    parts = [{"type": "text", "text": "what is this? "},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
             {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]  # fmt: skip
    (user,) = normalize([{"role": "user", "content": parts}])
    assert user["content"] == (
        "what is this? [an image was attached here; " + SEEN + "[audio was attached here; " + SEEN
    )


def test_a_conversation_holding_an_image_goes_on(server, claude, oai):
    block = [{"type": "text", "text": "hi"}, IMAGE]

    def count(content: list) -> int:
        messages = [{"role": "user", "content": content}]
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    assert count(block) > count(block[:1])  # the model reads the stand-in
    reply = claude.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": block}]
    )
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=4
    )
    assert chat.choices[0].finish_reason is not None
    item = {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                        {"type": "input_image", "image_url": "x"}]}  # fmt: skip
    r = requests.post(server[0] + "/v1/responses", json={"model": MODEL, "input": [item],
                                                         "max_output_tokens": 4})  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_final_assistant_message_is_continued(claude, oai):
    """Anthropic prefill: the answer goes on from the assistant's text instead of a new turn.
    The scripted model follows `</think>` with the answer, where a new turn would think first."""
    prefilled = ASK + [{"role": "assistant", "content": "</think>"}]
    msg = claude.messages.create(model=MODEL, max_tokens=20, messages=prefilled)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "The answer is 42."
    fresh = claude.messages.create(model=MODEL, max_tokens=20, messages=ASK)
    assert [b.type for b in fresh.content] == ["thinking", "text"]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=prefilled,
        max_tokens=20,
        extra_body={"continue_final_message": True},
    )
    assert r.choices[0].message.content == "The answer is 42."


def test_stop_lists_and_tool_schemas_are_checked(server, claude):
    url, _ = server
    stops = [f"s{i}" for i in range(17)]
    with pytest.raises(anthropic.BadRequestError, match="at most 16"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, stop_sequences=stops)
    r = requests.post(url + "/v1/chat/completions", json={"messages": ASK, "stop": stops})
    assert r.status_code == 400
    long_stop = {"messages": ASK, "max_tokens": 4, "stop": "x" * 40}  # one string: any length
    assert requests.post(url + "/v1/chat/completions", json=long_stop).status_code == 200
    for schema in ({"type": "string"}, {"type": "object", "properties": {"a": {"type": 3}}}):
        tool = {"name": "t", "input_schema": schema}
        with pytest.raises(anthropic.BadRequestError, match="input_schema"):
            claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[tool])
        fn = {"type": "function", "function": {"name": "t", "parameters": schema}}
        r = requests.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": [fn]})
        assert r.status_code == 400 and "parameters" in r.json()["error"]["message"]
    still_serves(url)


def test_the_openapi_document_describes_the_server(server):
    url, _ = server
    doc = requests.get(url + "/openapi.json").json()
    assert '"422"' not in json.dumps(doc)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
        assert "400" in doc["paths"][path]["post"]["responses"]
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["echo"].get("const") is False or completion["echo"].get("enum") == [False]
    assert all(
        v.get("minLength", 1) >= 1 and v.get("minItems", 1) >= 1
        for v in completion["prompt"]["anyOf"]
    )
    for refused in ({"prompt": "", "max_tokens": 2}, {"prompt": "x", "echo": True}):
        assert requests.post(url + "/v1/completions", json=refused).status_code == 400


def test_every_request_gets_an_access_log_line(server, caplog):
    url, _ = server
    with caplog.at_level(logging.INFO, logger="outrider.access"):
        still_serves(url)
        requests.post(url + "/v1/messages", json={"messages": []})
        requests.get(url + "/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "outrider.access"]
    chat = next(line for line in lines if '"POST /v1/chat/completions"' in line)
    assert " 200 " in chat and "ms prompt=" in chat and "completion=1" in chat
    assert any('"POST /v1/messages" 400 ' in line for line in lines)
    assert any('"GET /health" 200 ' in line for line in lines)


def test_trusted_templates_cannot_smuggle_what_requests_may_not_send(trusting):
    """A template can build a lone surrogate from an escape, or render nothing at all."""
    url, _ = trusting
    for template in ("{{ '\\ud800' }}", "{% if false %}{% endif %}"):
        body = {"messages": ASK, "max_tokens": 4, "chat_template": template}
        r = requests.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (template, r.text)
    still_serves(url)
