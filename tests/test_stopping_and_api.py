"""Stop tokens, stop strings and max tokens end exactly where plain decoding would; the
streaming and one-shot APIs agree."""

from __future__ import annotations

import pytest
from conftest import plain_greedy

import outrider
from outrider.core.errors import OutriderError


@pytest.fixture(scope="module")
def pipe(qwen3_target, drafters):
    return outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")


@pytest.fixture(scope="module")
def lookup_pipe(qwen3_target):
    return outrider.load(str(qwen3_target), mode="lookup")


@pytest.mark.parametrize("which", ["pipe", "lookup_pipe"])
def test_stop_token_ends_where_plain_decoding_would(request, qwen3_target, which):
    p = request.getfixturevalue(which)
    ids = p.encode("Count the stars.")
    ref = plain_greedy(qwen3_target, ids, 60)
    stop_tok = ref[17]  # a token the plain output reaches; generation ends at its first use
    first = ref.index(stop_tok)
    got = p.generate(ids, max_tokens=60, max_draft=6, stop_tokens={stop_tok})
    assert got.tokens == ref[:first]
    assert got.finish_reason == "stop"


def test_stop_string_cuts_text_and_tokens_at_the_same_place(pipe, qwen3_target):
    ids = pipe.encode("Tell me a story.")
    ref = plain_greedy(qwen3_target, ids, 60)
    full = pipe.tokenizer.decode(ref)
    stop = full[25:28]
    got = pipe.generate(ids, max_tokens=60, stop=[stop], stop_tokens=set())
    assert stop not in got.text
    assert got.text == full[: full.index(stop)]
    # tokens end with the first token whose text completes the stop string, as plain decoding
    n = next(i for i in range(1, 61) if stop in pipe.tokenizer.decode(ref[:i]))
    assert got.tokens == ref[:n]
    assert got.finish_reason == "stop"


def test_stream_equals_generate(pipe):
    ids = pipe.encode("Stream me.")
    chunks = list(pipe.stream(ids, max_tokens=50, stop_tokens=set()))
    assert chunks[-1].result is not None
    result = pipe.generate(ids, max_tokens=50, stop_tokens=set())
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.tokens] == result.tokens
    assert chunks[-1].result.tokens == result.tokens


def test_stream_holds_back_partial_stop_strings(pipe, qwen3_target):
    ids = pipe.encode("Hold it.")
    full = pipe.tokenizer.decode(plain_greedy(qwen3_target, ids, 40))
    stop = full[20:24]
    streamed = "".join(c.text for c in pipe.stream(ids, max_tokens=40, stop=[stop]))
    assert streamed == full[: full.index(stop)]


def test_max_tokens_zero_and_one(pipe, qwen3_target):
    ids = pipe.encode("Short.")
    assert pipe.generate(ids, max_tokens=0).tokens == []
    assert pipe.generate(ids, max_tokens=1, stop_tokens=set()).tokens == plain_greedy(
        qwen3_target, ids, 1
    )


def test_result_fields(pipe):
    res = pipe.generate("Fields.", max_tokens=20, stop_tokens=set())
    js = res.to_json()
    for key in (
        "text",
        "prompt_tokens",
        "tokens",
        "rounds",
        "mean_accept_len",
        "prefill_tps",
        "decode_tps",
        "peak_memory_gb",
        "mode",
        "max_draft",
    ):
        assert key in js
    assert js["mode"] == "dspark"
    assert all(set(r) == {"drafted", "accepted"} for r in js["rounds"])
    committed = 1 + sum(r["accepted"] + 1 for r in js["rounds"])
    assert committed >= len(js["tokens"])  # the last round may overshoot max_tokens
    assert js["mean_accept_len"] >= 1.0


def test_bad_arguments_are_clear(pipe, qwen3_target):
    with pytest.raises(OutriderError, match="max_tokens"):
        pipe.generate("x", max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        pipe.generate("x", temperature=-1)
    with pytest.raises(OutriderError, match="unknown mode 'warp'"):
        outrider.load(str(qwen3_target), mode="warp")
    with pytest.raises(OutriderError, match="needs a drafter"):
        outrider.load(str(qwen3_target), mode="dspark")
    with pytest.raises(OutriderError, match="no such folder"):
        outrider.load("./no/such/model")
    with pytest.raises(OutriderError, match="not in the Hugging Face cache"):
        outrider.load("nobody/no-such-model-xyz", download=False)


def test_reference_names(qwen3_target, drafters):
    pair = outrider.load_pair(str(qwen3_target), str(drafters["dspark"]))
    res = outrider.speculative_generate(pair, "Names.", max_tokens=8, stop_tokens=set())
    assert len(res.tokens) == 8


def test_generation_on_another_thread_than_loading(pipe, qwen3_target):
    """Servers load on one thread and generate on a worker thread."""
    from concurrent.futures import ThreadPoolExecutor

    ids = pipe.encode("Threads.")
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(pipe.generate, ids, max_tokens=20, stop_tokens=set()).result()
    assert got.tokens == plain_greedy(qwen3_target, ids, 20)


def test_seeded_sampling_is_reproducible(pipe):
    ids = pipe.encode("Seeds.")
    kw = dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234, stop_tokens=set())
    first = pipe.generate(ids, **kw).tokens
    assert pipe.generate(ids, **kw).tokens == first
    assert pipe.generate(ids, **{**kw, "seed": 4321}).tokens != first


@pytest.mark.parametrize("which", ["pipe", "lookup_pipe"])
def test_cancel_stops_prefill_between_chunks_and_decoding_between_rounds(
    request, which, monkeypatch
):
    """`cancelled` is asked before every prefill chunk: a prompt of many chunks stops after the
    chunks already asked for, with no token emitted; during decoding it stops at a round."""
    from outrider.core import target as target_mod

    monkeypatch.setattr(target_mod, "PREFILL_CHUNK", 8)
    p = request.getfixturevalue(which)
    ids = p.encode("Count the stars. " * 8)
    assert len(ids) > 6 * 8
    asked = []

    def after_two() -> bool:
        asked.append(1)
        return len(asked) > 2

    chunks = list(p.stream(ids, max_tokens=40, cancelled=after_two))
    result = chunks[-1].result
    assert result.finish_reason == "cancelled" and result.tokens == [] and len(asked) == 3
    full = p.generate(ids, max_tokens=40, stop_tokens=set())
    rounds = []

    def after_prefill() -> bool:
        rounds.append(1)
        return len(rounds) > len(ids) // 8 + 3  # prefill's chunks, then three rounds

    part = p.generate(ids, max_tokens=40, stop_tokens=set(), cancelled=after_prefill)
    assert part.finish_reason == "cancelled"
    assert 0 < len(part.tokens) < len(full.tokens)
    assert part.tokens == full.tokens[: len(part.tokens)]  # what was kept is exact


def test_ctrl_c_exits_130_with_one_line():
    import typer

    from outrider.cli import user_errors

    with pytest.raises(typer.Exit) as e:
        with user_errors():
            raise KeyboardInterrupt
    assert e.value.exit_code == 130


def test_a_tool_response_opener_ends_generation(tmp_path):
    """A model that begins `<|tool_response>` after its tool call is imagining the tool's
    answer (Gemma-4 did, to max_tokens): where the vocabulary holds the opener as one token, it
    is a stop token like end-of-turn. A vocabulary without it adds nothing."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from outrider.core.target import Target
    from outrider.testing.tokenizer import build_tokenizer

    build_tokenizer(tmp_path / "with", extra_tokens=("<|tool_response>", "<tool_response|>"))
    build_tokenizer(tmp_path / "without")
    with_opener = load_tokenizer(tmp_path / "with")
    opener = with_opener.convert_tokens_to_ids("<|tool_response>")
    end = with_opener.convert_tokens_to_ids("<|im_end|>")
    assert Target(None, with_opener, None).eos_token_ids == {end, opener}
    assert Target(None, load_tokenizer(tmp_path / "without"), None).eos_token_ids == {end}
