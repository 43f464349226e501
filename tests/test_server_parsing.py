"""Tool-call syntaxes and the <think> splitter, fed in every chunking a stream could produce."""

from __future__ import annotations

import pytest

from outrider.chat.reasoning import GEMMA_CHANNEL, ThinkSplitter, markers_for
from outrider.server.tools import ToolGate, parse_tool_calls

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    }
}
WANT = {"city": "Paris, FR", "days": 3}
SYNTAXES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}'
    "\n</tool_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3}<tool_call|>',
    "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "xml-bare": "<function=get_weather><parameter=city>Paris, FR</parameter>"
    "<parameter=days>3</parameter></function>",
    "lfm2": '<|tool_call_start|>[get_weather(city="Paris, FR", days=3)]<|tool_call_end|>',
    "lfm2-positional": '<|tool_call_start|>[get_weather("Paris, FR", 3)]<|tool_call_end|>',
    "atem": '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="city">'
    'Paris, FR</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>'
    "\n</atem:function_calls>",
    "minicpm5": '<function name="get_weather"><param name="city">Paris, FR</param>'
    '<param name="days">3</param></function>',
}


@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_each_syntax_parses_in_any_chunking(syntax, size):
    text = "Let me look. " + SYNTAXES[syntax]
    gate = ToolGate(SCHEMAS)
    released = "".join(gate.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = gate.finish()
    assert released == "Let me look. " and rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", WANT)]
    assert calls[0].id.startswith("call_")


def test_invalid_or_unknown_calls_stay_text():
    for text in (
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # truncated
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ):
        gate = ToolGate(SCHEMAS)
        assert gate.feed(text) == ""
        assert gate.finish() == (text, [])
    assert parse_tool_calls("no calls here", SCHEMAS) == ("no calls here", [])
    text = "a <tool_c"  # a marker prefix that never completes is released at the end
    gate = ToolGate(SCHEMAS)
    assert gate.feed(text) == "a " and gate.finish() == ("<tool_c", [])


def test_python_calls_are_read_never_run():
    """LFM2's calls are parsed as Python syntax: literal arguments only (a name or a call in an
    argument, a truncated call, an unknown tool: the whole block stays text); JSON's
    true/false/null read as Python's; two calls in one block come back in order."""
    for body in (
        '[get_weather(city=__import__("os").system("true"))]',
        "[get_weather(city=CITY)]",
        '[get_weather(city="Paris"',
        '[launch_rockets(when="now")]',
        '[get_weather("Paris", 3, "extra")]',  # more positional arguments than parameters
        "[print]",
    ):
        text = f"<|tool_call_start|>{body}<|tool_call_end|>"
        assert parse_tool_calls(text, SCHEMAS) == (text, []), body
    text = (
        '<|tool_call_start|>[get_weather(city="Oslo", days=null), '
        'get_weather(city="Rome", days=true)]<|tool_call_end|> Checking both.'
    )
    rest, calls = parse_tool_calls(text, SCHEMAS)
    assert rest == "Checking both."
    assert [c.arguments for c in calls] == [
        {"city": "Oslo", "days": None},
        {"city": "Rome", "days": True},
    ]


def test_two_atem_invokes_in_one_block():
    one = '<atem:invoke name="get_weather"><atem:parameter name="city">{}</atem:parameter></atem:invoke>'
    text = (
        "<atem:function_calls>" + one.format("Oslo") + one.format("42") + "</atem:function_calls>"
    )
    rest, calls = parse_tool_calls(text, SCHEMAS)
    assert rest == "" and [c.arguments["city"] for c in calls] == ["Oslo", "42"]  # a string


def test_two_calls_in_order():
    text = SYNTAXES["hermes"] + SYNTAXES["hermes"].replace("Paris, FR", "Oslo")
    rest, calls = parse_tool_calls(text, SCHEMAS)
    assert rest == "" and [c.arguments["city"] for c in calls] == ["Paris, FR", "Oslo"]


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_think_split_in_any_chunking(size):
    def run(text, in_thinking=False):
        s = ThinkSplitter(in_thinking)
        out = [p for i in range(0, len(text), size) for p in s.feed(text[i : i + size])]
        out += s.finish()
        join = lambda k: "".join(t for kind, t in out if kind == k)  # noqa: E731
        return join("reasoning"), join("content")

    assert run("<think>\nweigh it</think>\n\nAnswer.") == ("weigh it", "Answer.")
    assert run("weigh it</think>Answer.", in_thinking=True) == ("weigh it", "Answer.")
    assert run("  plain text <think>x</think>") == ("", "  plain text <think>x</think>")
    assert run("<think>never closed") == ("never closed", "")


@pytest.mark.parametrize("size", [1, 4, 100])
def test_gemma_thought_channel(size):
    assert markers_for("...{{ '<|channel>thought' }}...") == GEMMA_CHANNEL
    assert markers_for("{{ '<think>' }}") == ("<think>", "</think>")
    text = "<|channel>thought\nweigh it<channel|>Answer."
    s = ThinkSplitter(False, GEMMA_CHANNEL)
    out = [p for i in range(0, len(text), size) for p in s.feed(text[i : i + size])] + s.finish()
    assert "".join(t for k, t in out if k == "reasoning") == "weigh it"
    assert "".join(t for k, t in out if k == "content") == "Answer."


MUSE = "<|start|>assistant to=self<|message|>weigh it<|end|><|start|>assistant to=user<|message|>Answer.<|return|>"  # noqa: E501
HARMONY = "<|channel|>analysis<|message|>weigh it<|end|><|start|>assistant<|channel|>final<|message|>Answer."  # noqa: E501


@pytest.mark.parametrize("size", [1, 3, 7, 200])
@pytest.mark.parametrize(
    "text, want",
    [
        (MUSE, ("weigh it", "Answer.")),
        (MUSE.removeprefix("<|start|>assistant"), ("weigh it", "Answer.")),  # header prefilled
        (HARMONY, ("weigh it", "Answer.")),
        (
            "<|start|>assistant to=user<|message|>Just the answer, a <|x> b.",
            ("", "Just the answer, a <|x> b."),
        ),  # noqa: E501
        ("Hello!", ("", "Hello!")),  # a model that answered without channels
        ("No channels here at all. " * 8, ("", "No channels here at all. " * 8)),
        ("<|start|>assistant to=self<|message|>cut off mid-thou", ("cut off mid-thou", "")),
    ],
)
def test_channel_transcripts_split_into_reasoning_and_answer(text, want, size):
    """Muse-Glimmer's `to=self` / `to=user` channels (and the Harmony layout's analysis /
    final): the markers never reach the client, whatever the chunking."""
    from outrider.chat.reasoning import CHANNELS, ChannelSplitter, markers_for

    assert markers_for("...{{ '<|message|>' }}...") == CHANNELS
    s = ChannelSplitter()
    out = [p for i in range(0, len(text), size) for p in s.feed(text[i : i + size])] + s.finish()
    assert "".join(t for k, t in out if k == "reasoning") == want[0]
    assert "".join(t for k, t in out if k == "content") == want[1]


def test_a_prompt_that_opens_the_models_own_channel_starts_in_reasoning():
    from outrider.chat.reasoning import CHANNELS, ChannelSplitter, prompt_opens_thinking

    ask = "<|start|>user<|message|>Hi<|end|>"
    assert not prompt_opens_thinking(ask + "<|start|>assistant", CHANNELS)
    assert prompt_opens_thinking(ask + "<|start|>assistant to=self<|message|>", CHANNELS)
    assert not prompt_opens_thinking(ask + "<|start|>assistant to=user<|message|>", CHANNELS)
    s = ChannelSplitter(in_thinking=True)
    tail = "mull<|end|><|start|>assistant to=user<|message|>Hello."
    out = s.feed(tail) + s.finish()
    assert out == [("reasoning", "mull"), ("content", "Hello.")]


def test_a_channel_model_streams_its_answer_through_the_shaper():
    from outrider.chat.reasoning import CHANNELS
    from outrider.server.generation import Shaper

    shaper = Shaper(True, False, None, markers=CHANNELS)
    pieces = [p for ch in (MUSE[:30], MUSE[30:61], MUSE[61:]) for p in shaper.feed(ch)]
    rest, calls = shaper.finish()
    got = pieces + rest
    assert [k for k, _ in got if k == "reasoning"] and not calls
    assert "".join(t for k, t in got if k == "content") == "Answer."


def test_reasoning_effort_falls_back_to_the_nearest_word_the_template_knows():
    from outrider.chat.render import nearest_efforts, render_chat
    from outrider.core.errors import PromptError

    assert nearest_efforts("high")[:3] == ["high", "medium", "xhigh"]
    assert nearest_efforts(None) == [None]

    class Template:  # a tokenizer whose template accepts only some effort words
        chat_template = "{{ reasoning_effort }}"

        def __init__(self, known):
            self.known, self.seen = known, []

        def apply_chat_template(self, messages, reasoning_effort=None, **kw):
            self.seen.append(reasoning_effort)
            if reasoning_effort not in self.known:
                raise ValueError(f"unknown effort {reasoning_effort}")
            return f"<{reasoning_effort}>"

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    tok = Template({"low", "medium", "xhigh"})
    ids, *_ = render_chat(tok, [{"role": "user", "content": "hi"}], reasoning_effort="high")
    assert "".join(map(chr, ids)) == "<medium>" and tok.seen[:2] == ["high", "medium"]
    assert set(tok.seen[2:]) <= {"medium"}  # the generation prompt measured with it after
    with pytest.raises(PromptError, match="could not apply chat template"):
        render_chat(Template(set()), [{"role": "user", "content": "hi"}], reasoning_effort="low")


class AlwaysThinks:
    """A tokenizer whose template opens a think block whatever `enable_thinking` says (as
    LFM2.5-2.6B's does)."""

    chat_template = "{{ messages }}<|im_start|>assistant\n<think>\n"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + ("<|im_start|>assistant\n<think>\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@pytest.mark.parametrize("thinking", [False, None, True])
def test_thinking_off_closes_a_think_block_the_template_opens_anyway(thinking):
    from outrider.chat.render import render_chat
    from outrider.prompts import encode_messages

    ask = [{"role": "user", "content": "hi"}]
    ids, opens, *_ = render_chat(AlwaysThinks(), ask, thinking=thinking)
    cli = "".join(map(chr, encode_messages(AlwaysThinks(), ask, thinking=thinking)))
    text = "".join(map(chr, ids))
    assert text == cli
    if thinking is False:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not opens
    else:  # the template's own choice stands: the model thinks, and its output is reasoning
        assert text.endswith("<think>\n") and opens
    # where the user's message ended (the next turn resumes there), the closed block or not
    boundary = render_chat(AlwaysThinks(), ask, thinking=thinking).boundary
    assert text[:boundary].endswith("hi<|im_end|>\n") and 0 < boundary < len(text)


def test_merged_chunks_keep_every_round_for_the_ribbon():
    """Chunks that pile up behind a slow client go out as one frame; its telemetry still lists
    each round (it used to keep the last one only)."""
    from outrider.core.round import Step
    from outrider.server.generation import merge
    from outrider.server.openai_api import _StepReport
    from outrider.streaming import Chunk

    def chunk(drafted: list[int], accepted: int) -> Chunk:
        kept = drafted[:accepted] + [9]
        return Chunk("x", kept, Step("draft", drafted, accepted, kept, 0.01))

    merged = merge(merge(chunk([1, 2, 3], 1), chunk([4, 5], 2)), chunk([6, 7, 8, 9], 0))
    assert merged.text == "xxx" and merged.tokens == [1, 9, 4, 5, 9, 9]
    report = _StepReport()
    report.add(merged)
    assert report.take() == {"tokens": 6, "ribbon": [[3, 1], [2, 2], [4, 0]]}
