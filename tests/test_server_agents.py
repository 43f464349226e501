"""Tool calls, thinking and the Anthropic Messages API through the real `anthropic` and `openai`
SDKs, against a scripted tiny target (a real Llama whose answers are known in advance)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import requests
from live_server import live_server, sse_frames

from outrider.server.engine import LoadSpec
from outrider.server.generation import Limits
from outrider.testing import make_scripted_target

WINDOW = 400
TOOLS_A = [
    {
        "name": "get_weather",
        "description": "Weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
TOOLS_O = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": TOOLS_A[0]["input_schema"],
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
LIMITS = Limits(keepalive_s=5)  # the server's defaults; a test may change one and restore it


@pytest.fixture(scope="module")
def server(models_dir):
    path = make_scripted_target(models_dir / "scripted")
    spec = LoadSpec(str(path), mode="lookup", context_window=WINDOW)
    with live_server(spec, LIMITS) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_anthropic_thinking_blocks_stream_and_not(claude):
    msg = claude.messages.create(model="scripted", max_tokens=50, messages=ASK)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Thinking it over."
    assert msg.content[1].text == "The answer is 42."
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens == 4  # <think>, reasoning, </think>, answer (eos not counted)
    count = claude.messages.count_tokens(model="scripted", messages=ASK)
    assert count.input_tokens == msg.usage.input_tokens
    with claude.messages.stream(model="scripted", max_tokens=50, messages=ASK) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    off = claude.messages.create(
        model="scripted", max_tokens=50, messages=ASK, thinking={"type": "disabled"}
    )
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "The answer is 42."


def test_anthropic_tool_round_trip(claude):
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    count = claude.messages.count_tokens(model="scripted", messages=ASK, tools=TOOLS_A)
    with_server_tool = claude.messages.count_tokens(
        model="scripted", messages=ASK, tools=TOOLS_A + [server_tool]
    )
    assert with_server_tool.input_tokens == count.input_tokens  # server tools are not offered
    first = claude.messages.create(model="scripted", max_tokens=60, messages=ASK, tools=TOOLS_A)
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert (
        call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    )
    with claude.messages.stream(
        model="scripted", max_tokens=60, messages=ASK, tools=TOOLS_A
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[-1].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    second = claude.messages.create(
        model="scripted", max_tokens=60, messages=history, tools=TOOLS_A
    )
    assert second.content[-1].text == "It is sunny in Paris."
    assert second.stop_reason == "end_turn"


def test_anthropic_stop_sequences_and_limits(claude, server):
    msg = claude.messages.create(
        model="scripted",
        max_tokens=50,
        messages=ASK,
        stop_sequences=["42"],
        thinking={"type": "disabled"},
    )
    assert msg.content[0].text == "The answer is "
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "42"
    short = claude.messages.create(model="scripted", max_tokens=2, messages=ASK)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="scripted", max_tokens=5, messages=[{"role": "user", "content": "w" * 500}]
        )
    n = e.value.body["error"]["message"]
    assert e.value.body["type"] == "error"
    assert n.startswith("prompt is too long: ") and n.endswith(f" tokens > {WINDOW} maximum")
    r = requests.post(server[0] + "/v1/messages?beta=true", json={"messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-9", max_tokens=5, messages=ASK)
    ok = claude.messages.create(model="scripted", max_tokens=5, messages=ASK)
    assert ok.usage.output_tokens > 0


def test_anthropic_stream_events_in_order(server):
    body = {"model": "scripted", "max_tokens": 50, "messages": ASK, "stream": True}
    with requests.post(server[0] + "/v1/messages", json=body, stream=True) as r:
        frames = sse_frames(r)
    events = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert events[:2] == ["message_start", "ping"]
    assert events[-2:] == ["message_delta", "message_stop"]
    data = [json.loads(f.split("\n")[1][6:]) for f in frames]
    deltas = [d["delta"]["type"] for d in data if d["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta"]


def test_openai_reasoning_and_tool_round_trip(oai):
    r = oai.chat.completions.create(model="scripted", messages=ASK, max_tokens=50)
    msg = r.choices[0].message
    assert msg.content == "The answer is 42."
    assert msg.model_extra["reasoning_content"] == "Thinking it over."
    off = oai.chat.completions.create(
        model="scripted", messages=ASK, max_tokens=50, extra_body={"enable_thinking": False}
    )
    assert off.choices[0].message.content == "The answer is 42."
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    plain = oai.chat.completions.create(model="scripted", messages=ASK, max_tokens=5)
    effort = oai.chat.completions.create(
        model="scripted", messages=ASK, max_tokens=5, reasoning_effort="low"
    )
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens  # the template saw it
    stream = oai.chat.completions.create(model="scripted", messages=ASK, max_tokens=50, stream=True)
    reasoning, content = [], []
    for chunk in stream:
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == "Thinking it over." and "".join(content) == "The answer is 42."

    first = oai.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS_O)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = oai.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS_O, stream=True)
    calls, finish, text = [], None, []
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and "".join(text) == ""
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = oai.chat.completions.create(model="scripted", messages=history, tools=TOOLS_O)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    raw = oai.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS_O, tool_choice="none"
    )
    assert raw.choices[0].message.content.startswith("<tool_call>")


def test_the_servers_reasoning_effort_is_the_default_a_request_can_override(oai, claude):
    """`outrider serve --reasoning-effort E`: a request that names no effort renders as one
    that names E; one that names its own keeps it."""
    plain = oai.chat.completions.create(model="scripted", messages=ASK, max_tokens=1)
    low = oai.chat.completions.create(
        model="scripted", messages=ASK, max_tokens=1, reasoning_effort="low"
    )
    high = oai.chat.completions.create(
        model="scripted", messages=ASK, max_tokens=1, reasoning_effort="high"
    )
    counted = claude.messages.count_tokens(model="scripted", messages=ASK).input_tokens
    LIMITS.reasoning_effort = "low"
    try:
        default = oai.chat.completions.create(model="scripted", messages=ASK, max_tokens=1)
        kept = oai.chat.completions.create(
            model="scripted", messages=ASK, max_tokens=1, reasoning_effort="high"
        )
        defaulted = claude.messages.count_tokens(model="scripted", messages=ASK).input_tokens
    finally:
        LIMITS.reasoning_effort = None
    assert plain.usage.prompt_tokens < low.usage.prompt_tokens  # the template reads it
    assert default.usage.prompt_tokens == low.usage.prompt_tokens
    assert kept.usage.prompt_tokens == high.usage.prompt_tokens
    assert defaulted > counted


def test_mid_conversation_system_message_is_folded(oai):
    msgs = ASK + [
        {"role": "assistant", "content": "Let me check."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Well?"},
    ]
    r = oai.chat.completions.create(model="scripted", messages=msgs, max_tokens=50)
    assert r.choices[0].message.content == "The answer is 42."


# --- OpenAI's Responses API (/v1/responses) -------------------------------------------------

TOOLS_R = [{"type": "function", **TOOLS_O[0]["function"]}]
QUESTION = ASK[0]["content"]


def test_responses_api_reasoning_text_and_stream(oai):
    r = oai.responses.create(model="scripted", input=QUESTION, max_output_tokens=50)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Thinking it over."
    assert r.output_text == "The answer is 42."
    assert r.status == "completed" and r.usage.output_tokens == 4
    events = list(
        oai.responses.create(model="scripted", input=QUESTION, max_output_tokens=50, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (deltas, thought) == ("The answer is 42.", "Thinking it over.")
    final = events[-1].response
    assert final.output_text == r.output_text and [o.type for o in final.output] == [
        "reasoning",
        "message",
    ]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    short = oai.responses.create(model="scripted", input=QUESTION, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_api_function_call_round_trip(oai):
    first = oai.responses.create(
        model="scripted", input=QUESTION, tools=TOOLS_R, max_output_tokens=60
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(
        oai.responses.create(
            model="scripted", input=QUESTION, tools=TOOLS_R, max_output_tokens=60, stream=True
        )
    )
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"} and done.name == "get_weather"
    history = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]  # fmt: skip
    second = oai.responses.create(
        model="scripted", input=history, tools=TOOLS_R, max_output_tokens=60
    )
    assert second.output_text == "It is sunny in Paris."


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ],
)
def test_responses_api_refuses_what_it_does_not_do(server, extra, param):
    body = {"model": "scripted", "input": QUESTION, **extra}
    r = requests.post(server[0] + "/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


OFF = {"enable_thinking": False}  # the scripted template then answers without a call


def test_openai_tool_choice_required_forces_a_call(oai, server):
    free = oai.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS_O, max_tokens=20, extra_body=OFF
    )
    assert free.choices[0].message.content == "The answer is 42."  # no call unforced
    forced = oai.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS_O, max_tokens=20, extra_body=OFF,
        tool_choice="required",
    )  # fmt: skip
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert forced.usage.prompt_tokens > free.usage.prompt_tokens  # the opening is prompt
    stream = oai.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS_O, max_tokens=20, extra_body=OFF,
        tool_choice="required", stream=True,
    )  # fmt: skip
    calls = [tc for chunk in stream for c in chunk.choices for tc in c.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]


def test_anthropic_and_responses_tool_choice_force_a_call(claude, oai):
    msg = claude.messages.create(
        model="scripted", max_tokens=20, messages=ASK, tools=TOOLS_A,
        thinking={"type": "disabled"}, tool_choice={"type": "any"},
    )  # fmt: skip
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in msg.content] == [("tool_use", {"city": "Paris"})]
    tools = [{"type": "function", **TOOLS_O[0]["function"]}]
    r = oai.responses.create(
        model="scripted", input="What is the weather in Paris?", tools=tools,
        tool_choice="required", max_output_tokens=20,
    )  # fmt: skip
    assert [(o.type, o.name) for o in r.output if o.type == "function_call"] == [
        ("function_call", "get_weather")
    ]


@pytest.mark.parametrize(
    "choice,tools,words",
    [
        ("required", None, "no tools were given"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS_O, "'nope'"),
        ({"type": "custom"}, TOOLS_O, "unsupported tool_choice type"),
    ],
)
def test_openai_tool_choice_refusals_name_the_field(server, choice, tools, words):
    body = {"model": "scripted", "messages": ASK, "tool_choice": choice, "max_tokens": 5}
    if tools:
        body["tools"] = tools
    r = requests.post(server[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and words in err["message"]


def test_call_openings_follow_the_templates_syntax():
    from outrider.server.tool_choice import call_opening

    assert call_opening("{{ '<tool_call>' }}", None) == "<tool_call>"
    named = call_opening("{{ '<tool_call>' }}", "get_weather")
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert call_opening("<|tool_call>call:", "f") == "<|tool_call>call:f{"
    assert call_opening("<tool_call><function=", "f") == "<tool_call>\n<function=f>"
    lfm2 = "<|tool_list_start|>{{ tools }}<|tool_list_end|>"
    assert call_opening(lfm2, "f") == "<|tool_call_start|>[f("
    assert (
        call_opening("{{ '<atem:invoke' }}", "f") == '<atem:function_calls>\n<atem:invoke name="f">'
    )
    assert call_opening("{{ messages }}", None) is None


def test_a_thinking_budget_closes_the_thinking(claude, oai, server):
    # the script thinks one token ("Thinking it over.") then closes: a budget of one keeps
    # the model's own closer, a budget of zero closes the block in the model's place
    whole = claude.messages.create(
        model="scripted", max_tokens=50, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1},
    )  # fmt: skip
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "Thinking it over."
    cut = claude.messages.create(
        model="scripted", max_tokens=50, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 0},
    )  # fmt: skip
    assert cut.content[0].type == "thinking"
    assert cut.content[0].thinking.strip() == "I have to answer now."
    raw = requests.post(
        server[0] + "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 50, "reasoning_budget": 0},
        timeout=60,
    ).json()
    assert raw["x_outrider"]["budget_forced"] is True
    assert raw["choices"][0]["message"]["reasoning_content"].strip() == "I have to answer now."
    free = oai.chat.completions.create(model="scripted", max_tokens=50, messages=ASK)
    assert free.model_extra["x_outrider"]["budget_forced"] is False
    bad = requests.post(
        server[0] + "/v1/messages",
        json={
            "model": "scripted",
            "max_tokens": 50,
            "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": -1},
        },  # fmt: skip
        timeout=60,
    )
    assert bad.status_code == 400 and "budget_tokens" in bad.text
