"""`outrider serve` through the real `openai` SDK: a live server on 127.0.0.1 with a tiny Qwen3
and a DSpark drafter (speculation on), compared against mlx-lm's plain greedy decoding."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
import requests
from conftest import plain_greedy
from live_server import detok, live_server, sse_frames

from outrider.prompts import encode_messages
from outrider.server.engine import LoadSpec
from outrider.server.generation import Limits

KEY = "sekret-key"
WINDOW = 4000  # below the model's own 4096, so the override is what refuses


@pytest.fixture(scope="module")
def server(qwen3_target, drafters):
    spec = LoadSpec(str(qwen3_target), str(drafters["dspark"]), "dspark", context_window=WINDOW)
    limits = Limits(default_max_tokens=32, max_tokens_cap=4096, keepalive_s=0.25)
    with live_server(spec, limits, api_key=KEY) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(server):
    return server[1].pipeline.tokenizer


def expected(target, tok, messages, n):
    ids = encode_messages(tok, messages)
    return ids, plain_greedy(target, ids, n)


MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_chat_stream_equals_nonstream_equals_plain_greedy(client, tok, qwen3_target, server):
    n = 24
    ids, want = expected(qwen3_target, tok, MSGS, n)
    eos = server[1].pipeline.target.eos_token_ids
    cut = next((i for i, t in enumerate(want) if t in eos), n)
    want_text = detok(tok, want[:cut])
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=n)
    assert r.choices[0].message.content == want_text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == cut
    assert r.usage.total_tokens == len(ids) + cut
    x = r.model_extra["x_outrider"]
    assert x["mode"] == "dspark" and x["mean_accept_len"] >= 1.0
    assert (x["prompt_tokens"], x["completion_tokens"]) == (len(ids), cut)
    assert 0 <= x["cached_tokens"] < len(ids) and x["ttft_seconds"] == x["prefill_seconds"] > 0
    # one forward a round or plain step after the prefill, each committing at least a token
    assert x["rounds"] <= x["target_forwards"] <= cut - 1 + (cut < n)
    assert x["context_tokens"] == len(ids) + cut and x["auto_cap"] is False
    assert x["plain_steps"] == x["target_forwards"] - x["rounds"] == 0  # a fixed cap: no parking
    seconds = x["prefill_seconds"] + x["decode_seconds"]
    assert x["tokens_per_sec"] == pytest.approx(cut / seconds, rel=0.02, abs=0.01)
    stream = client.chat.completions.create(
        model="qwen3",
        messages=MSGS,
        max_tokens=n,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == want_text
    assert finish == r.choices[0].finish_reason
    assert usage.completion_tokens == cut and usage.prompt_tokens == len(ids)


def test_completions_equal_plain_greedy(client, tok, qwen3_target):
    prompt = "def fibonacci(n):"
    ids = list(tok.encode(prompt))
    want = plain_greedy(qwen3_target, ids, 20)
    r = client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == detok(tok, want)
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=20, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == detok(tok, want)


def test_stop_sequence_cuts_where_plain_text_has_it(client, tok, qwen3_target):
    prompt = "What is 12 times 7?"
    ids = list(tok.encode(prompt))
    full = detok(tok, plain_greedy(qwen3_target, ids, 30))
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].isprintable())
    assert stop in full
    r = client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=30, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_seed_and_penalties(client, server):
    r = client.chat.completions.create(
        model="qwen3", messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-5  # greedy takes the top token
    stream = client.chat.completions.create(
        model="qwen3", messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [lp for c in stream for ch in c.choices if ch.logprobs for lp in ch.logprobs.content]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    kw = dict(model="qwen3", messages=MSGS, max_tokens=12, temperature=0.9, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    pipe = server[1].pipeline
    from outrider.core.logits import Penalties

    pen = client.chat.completions.create(
        model="qwen3",
        messages=MSGS,
        max_tokens=20,
        presence_penalty=1.5,
        extra_body={"ignore_eos": True},
    )
    ids = encode_messages(pipe.tokenizer, MSGS)
    want = pipe.generate(ids, max_tokens=20, stop_tokens=set(), penalties=Penalties(1.5))
    assert pen.choices[0].message.content == want.text


def test_models_health_metrics(client, server):
    url = server[0]
    client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=8)
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3"]
    h = requests.get(url + "/health", headers={"x-api-key": KEY}).json()
    assert h["status"] == "ok" and h["mode"] == "dspark" and h["context_window"] == WINDOW
    assert h["capabilities"]["chat_template"] is True
    m = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    lines = m.text.splitlines()
    assert any(line.startswith("outrider_completion_tokens_total{") for line in lines)
    count = [line for line in lines if line.startswith("outrider_accept_length_count")]
    assert count and float(count[0].split()[-1]) > 0
    assert "# TYPE outrider_accept_length histogram" in lines
    # the same counters as one JSON object
    j = requests.get(url + "/metrics?format=json", headers={"x-api-key": KEY}).json()
    assert j["model"] == "qwen3" and j["mode"] == "dspark"
    total = next(line for line in lines if line.startswith("outrider_completion_tokens_total{"))
    assert j["completion_tokens"] == float(total.split()[-1]) > 0
    assert sum(j["accept_lengths"].values()) == float(count[0].split()[-1])
    assert j["mean_accept_length"] >= 1.0 and {"rounds", "rows_max"} <= set(j["batch"])
    assert requests.get(url + "/metrics?format=xml", headers={"x-api-key": KEY}).status_code == 400


def _status(fn):
    try:
        fn()
    except openai.APIStatusError as e:
        return e.status_code, e.body
    raise AssertionError("the request succeeded")


def test_bad_input_is_refused_and_the_server_keeps_serving(client, server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    cases = [
        requests.post(url + "/v1/chat/completions", data="{not json", headers=headers),
        requests.post(url + "/v1/chat/completions", json={"messages": "hi"}, headers=headers),
        requests.post(url + "/v1/chat/completions", json={"messages": []}, headers=headers),
        requests.post(url + "/v1/completions", json={"prompt": 5}, headers=headers),
    ]
    for r in cases:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"]
    msgs = [{"role": "user", "content": "hi"}]
    status, body = _status(lambda: client.chat.completions.create(model="gpt-9", messages=msgs))
    assert status == 404 and body["code"] == "model_not_found"
    for bad in (-1, 0, 10**9):
        status, body = _status(
            lambda bad=bad: client.chat.completions.create(
                model="qwen3", messages=msgs, max_tokens=bad
            )
        )
        assert status == 400 and "max_tokens" in body["message"]
    for n, stream in ((2, True), (17, False), (0, False)):  # n > 1 is for whole answers
        status, body = _status(
            lambda n=n, stream=stream: client.chat.completions.create(
                model="qwen3", messages=msgs, n=n, stream=stream
            )
        )
        assert status == 400 and (body["param"] == "n" or " n: " in body["message"]), body
    bad_tool = [{"type": "function", "function": {"name": "has spaces!", "parameters": {}}}]
    status, _ = _status(
        lambda: client.chat.completions.create(model="qwen3", messages=msgs, tools=bad_tool)
    )
    assert status == 400
    status, body = _status(
        lambda: client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "x" * (WINDOW + 10)}]
        )
    )
    assert status == 400 and body["code"] == "context_length_exceeded"
    status, _ = _status(
        lambda: client.completions.create(model="qwen3", prompt="y" * (WINDOW + 10))
    )
    assert status == 400
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = requests.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = requests.post(url + "/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    ok = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", headers={"x-api-key": KEY}).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + "{"))


def test_keepalive_while_queued_and_disconnect_frees_the_worker(server, client):
    url, engine = server
    headers = {"x-api-key": KEY}
    long = {"model": "qwen3", "prompt": "z", "max_tokens": 450, "ignore_eos": True}
    # Occupy the worker, then stream a request that waits behind it: keep-alives arrive.
    blocker = threading.Thread(
        target=lambda: requests.post(url + "/v1/completions", json=long, headers=headers)
    )
    blocker.start()
    time.sleep(0.05)
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 4, "stream": True}
    with requests.post(url + "/v1/chat/completions", json=body, headers=headers, stream=True) as r:
        frames = sse_frames(r)
    blocker.join()
    chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert any(d == {} for d in deltas[1:first_content]), "no empty-delta keep-alive while queued"
    assert frames[-1] == "data: [DONE]"
    # A client that vanishes mid-stream stops its generation at the next round.
    before_tokens = _metric(url, "outrider_completion_tokens_total")
    before_cancel = _metric(url, "outrider_cancelled_total")
    big = {**long, "max_tokens": 4000, "stream": True}
    r = requests.post(url + "/v1/completions", json=big, headers=headers, stream=True)
    next(r.iter_lines())
    r.close()
    quick = client.completions.create(
        model="qwen3", prompt="q", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert quick.usage.completion_tokens == 3  # served: the abandoned one freed the worker
    deadline = time.time() + 120  # a hang guard, not a timing assertion
    while _metric(url, "outrider_cancelled_total") == before_cancel and time.time() < deadline:
        time.sleep(0.05)
    assert _metric(url, "outrider_cancelled_total") == before_cancel + 1
    spent = _metric(url, "outrider_completion_tokens_total") - before_tokens - 3
    assert spent < 1000  # of 4000 asked for
    # The same for a non-streaming request whose client gives up.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(
            url + "/v1/completions", json={**long, "max_tokens": 4000}, headers=headers, timeout=1
        )
    deadline = time.time() + 120  # a hang guard, not a timing assertion
    while _metric(url, "outrider_cancelled_total") < before_cancel + 2 and time.time() < deadline:
        time.sleep(0.05)
    assert _metric(url, "outrider_cancelled_total") == before_cancel + 2


def _rss_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_sixteen_concurrent_streams_and_flat_memory(server, tok, qwen3_target):
    url = server[0]
    prompts = [f"Count to {i}:" for i in range(16)]
    want = {p: detok(tok, plain_greedy(qwen3_target, list(tok.encode(p)), 12)) for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model="qwen3",
            prompt=prompt,
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert dict(zip(prompts, got)) == want
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(30):  # warm-up: allocator pools and caches reach their steady size
        client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=2)
    start = _rss_mb()
    for _ in range(100):
        r = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=2)
        assert r.usage.completion_tokens >= 1
    growth = _rss_mb() - start
    assert growth < 32, f"RSS grew {growth:.1f} MB over 100 requests"
