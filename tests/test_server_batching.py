"""Continuous batching (`--max-batch`): concurrent requests through the real `openai` and
`anthropic` SDKs share target forwards, and every response equals the same request served
alone (plain greedy decoding of its prompt)."""

from __future__ import annotations

import asyncio
import time

import anthropic
import openai
import pytest
import requests
from conftest import plain_greedy
from live_server import detok, live_server

from outrider.prompts import encode_messages
from outrider.server.engine import LoadSpec
from outrider.server.generation import Limits


@pytest.fixture(scope="module")
def server(qwen3_target, drafters):
    spec = LoadSpec(str(qwen3_target), str(drafters["dspark"]), "dspark")
    limits = Limits(default_max_tokens=16, max_tokens_cap=4096, keepalive_s=0.25)
    with live_server(spec, limits, max_batch=4) as (url, engine):
        yield url, engine


def metric(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_concurrent_streams_are_batched_and_each_equals_plain_greedy(server, qwen3_target):
    url, engine = server
    tok = engine.pipeline.tokenizer
    asks = [(f"Count to {i}, then stop.", 6 + 3 * i) for i in range(7)]
    want = {}
    for text, n in asks:
        ids = encode_messages(tok, [{"role": "user", "content": text}])
        want[text] = detok(tok, plain_greedy(qwen3_target, ids, n))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    async def one(text: str, n: int) -> str:
        stream = await client.chat.completions.create(
            model="qwen3",
            messages=[{"role": "user", "content": text}],
            max_tokens=n,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.gather(*(one(t, n) for t, n in asks))

    got = asyncio.run(all_of_them())
    assert dict(zip([t for t, _ in asks], got)) == want
    assert metric(url, "outrider_batch_rows_max") > 1  # requests really shared rounds
    assert metric(url, "outrider_in_flight") == 0


@pytest.mark.slow
def test_anthropic_and_openai_clients_share_a_batch_and_a_leaver_harms_none(server, qwen3_target):
    """One client leaves mid-stream; the others (both APIs) still get their own output."""
    url, engine = server
    tok = engine.pipeline.tokenizer
    texts = [f"Say {w}." for w in ("red", "green", "blue")]
    want = {
        t: detok(tok, plain_greedy(qwen3_target, encode_messages(tok, [{"role": "user", "content": t}]), 20))
        for t in texts
    }  # fmt: skip
    oai = claude = None
    before = engine.metrics.completion_tokens
    msgs = lambda t: [{"role": "user", "content": t}]  # noqa: E731

    async def leaver() -> None:
        stream = await oai.chat.completions.create(
            model="qwen3", messages=msgs("Talk at length."), max_tokens=4000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            break
        await stream.close()

    async def via_openai(t: str) -> str:
        r = await oai.chat.completions.create(
            model="qwen3", messages=msgs(t), max_tokens=20, extra_body={"ignore_eos": True}
        )
        return r.choices[0].message.content

    async def via_anthropic(t: str) -> str:
        r = await claude.messages.create(
            model="qwen3", messages=msgs(t), max_tokens=20, extra_body={"ignore_eos": True}
        )
        return r.content[0].text

    async def all_of_them():
        nonlocal oai, claude
        async with (
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oai,
            anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as claude,
        ):
            return await asyncio.gather(
                leaver(), via_openai(texts[0]), via_anthropic(texts[1]), via_openai(texts[2])
            )

    _, a, b, c = asyncio.run(all_of_them())
    assert {texts[0]: a, texts[1]: b, texts[2]: c} == want
    while engine.metrics.in_flight:  # the leaver's 4,000 tokens end it if its cancel never did
        time.sleep(0.02)
    assert metric(url, "outrider_cancelled_total") >= 1
    assert engine.metrics.completion_tokens - before < 4000  # the leaver was cut short


def test_n_choices_are_generations_of_their_own(server, qwen3_target):
    """n = 3: three choices; greedy, each is plain greedy decoding; sampled with a seed,
    choice i samples with seed + i, so they differ and a repeat gives the same three."""
    url, engine = server
    tok = engine.pipeline.tokenizer
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Name three colours."}]
    want = detok(tok, plain_greedy(qwen3_target, encode_messages(tok, msgs), 12))
    r = client.chat.completions.create(
        model="qwen3", messages=msgs, n=3, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [want] * 3
    assert r.usage.completion_tokens == 36

    def sampled() -> list[str]:
        r = client.completions.create(
            model="qwen3", prompt="Once upon a time", n=3, max_tokens=16, temperature=1.0,
            seed=7, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.text for c in r.choices]

    first = sampled()
    assert len(set(first)) > 1 and sampled() == first


def test_a_batch_that_never_drains_still_trims_the_heap(server, qwen3_target):
    """The engine asks its `HeapTrim` between batched rounds, not only between batches: a busy
    server's batch may never drain. Answers stay equal to plain greedy decoding."""
    from outrider.server.memory import HeapTrim

    url, engine = server
    calls: list[int] = []
    kept, engine.heap_trim = engine.heap_trim, HeapTrim(every_s=0.0, trim=calls.append)
    try:
        tok = engine.pipeline.tokenizer
        ids = encode_messages(tok, [{"role": "user", "content": "Trim me."}])
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got = client.chat.completions.create(
            model="qwen3",
            messages=[{"role": "user", "content": "Trim me."}],
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
    finally:
        engine.heap_trim = kept
    assert got.choices[0].message.content == detok(tok, plain_greedy(qwen3_target, ids, 12))
    assert len(calls) >= 2  # before the generation, and again between its rounds
