"""Requests that set no sampling: the served model's recommendation (generation_config.json or a
GGUF's general.sampling keys) fills each unset field, `serve --default-*` flags override it,
and a request's own value overrides both. Without any, an unset temperature is greedy."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from cli_runner import invoke
from live_server import live_server

from outrider.core.generation_config import SamplingDefaults, read
from outrider.server.engine import LoadSpec
from outrider.server.generation import Limits
from outrider.testing import make_tiny_target
from outrider.testing.gguf import make_tiny_gguf

ASK = [{"role": "user", "content": "Tell me a story about the sea."}]
RECOMMENDED = {"do_sample": True, "temperature": 1.8, "top_p": 0.97, "top_k": 40}


def folder_with(tmp_path, cfg) -> object:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = cfg if isinstance(cfg, str) else json.dumps(cfg)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "cfg, want, noted",
    [
        (RECOMMENDED, SamplingDefaults(1.8, 0.97, 40), None),
        # Transformers decodes greedily without do_sample, whatever the other fields say
        ({"temperature": 0.6, "top_p": 0.9}, SamplingDefaults(), None),
        ({"do_sample": False, "temperature": 0.6}, SamplingDefaults(), None),
        # and samples at its default temperature, 1, when do_sample comes alone
        ({"do_sample": True, "top_p": 0.8}, SamplingDefaults(1.0, 0.8), None),
        ({"do_sample": True, "temperature": 7, "top_k": 20}, SamplingDefaults(None, None, 20),
         "temperature 7 is not a number in [0, 2]"),
        ({"do_sample": True, "temperature": 0.7, "top_k": 2.5}, SamplingDefaults(0.7),
         "top_k 2.5 is not a whole number"),
        ({"do_sample": True, "temperature": "warm"}, SamplingDefaults(), "temperature 'warm'"),
        ("{not json", SamplingDefaults(), "generation_config.json is unreadable"),
        ("[1, 2]", SamplingDefaults(), "is not a JSON object"),
    ],
)  # fmt: skip
def test_generation_config_is_read_as_transformers_reads_it(tmp_path, cfg, want, noted):
    got, notes = read(folder_with(tmp_path, cfg))
    assert got.as_dict() == want.as_dict()
    if noted is None:
        assert notes == []
    else:
        assert len(notes) == 1 and noted in notes[0] and notes[0].endswith("ignored")


def test_no_generation_config_is_no_opinion(tmp_path):
    assert read(tmp_path) == (SamplingDefaults(), [])


def test_a_gguf_files_sampling_keys(tmp_path):
    path = make_tiny_gguf(tmp_path / "t.gguf", sampling={"temp": 0.6, "top_p": 0.95, "top_k": 20})
    got, notes = read(path)
    assert got.as_dict() == pytest.approx({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert notes == [] and got.source == "t.gguf"
    bare = make_tiny_gguf(tmp_path / "bare.gguf", tmp_path / "t-hf")
    assert read(bare) == (SamplingDefaults(), [])


def test_flags_fill_in_over_the_model_field_by_field():
    model = SamplingDefaults(0.6, 0.95, 20, source="generation_config.json")
    flags = SamplingDefaults(top_k=5, source="--default-*")
    both = flags.over(model)
    assert both.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 5}
    assert both.source == "--default-* over generation_config.json"
    assert SamplingDefaults().over(SamplingDefaults()).set() is False


@pytest.fixture(scope="module")
def recommending(tmp_path_factory):
    """A tiny model whose publisher recommends hot sampling."""
    path = make_tiny_target(tmp_path_factory.mktemp("m") / "hot", family="qwen3")
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return path


def chat(url: str, **sampling) -> str:
    """The OpenAI answer to ASK with these sampling fields (seed 7: sampled answers repeat)."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = oai.chat.completions.create(
        model="hot", messages=ASK, max_tokens=24, seed=7, extra_body=sampling
    )
    return reply.choices[0].message.content


def message(url: str, **sampling) -> str:
    """The Anthropic answer (its API has no seed: only greedy answers repeat)."""
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    msg = claude.messages.create(model="hot", messages=ASK, max_tokens=24, extra_body=sampling)
    return "".join(b.text for b in msg.content if b.type == "text")


def test_unset_sampling_takes_the_models_recommendation(recommending):
    spec = LoadSpec(str(recommending), mode="baseline")
    with live_server(spec, Limits()) as (url, _):
        health = openai.OpenAI(base_url=url, api_key="x")._client.get(url + "/health").json()
        assert health["sampling_defaults"] == {"temperature": 1.8, "top_p": 0.97, "top_k": 40}
        unset = chat(url)
        recommended = chat(url, temperature=1.8, top_p=0.97, top_k=40)
        greedy = chat(url, temperature=0.0)
    assert unset == recommended
    assert unset != greedy  # what the test tells apart: sampled, not greedy


def test_serve_flags_override_the_model_and_requests_override_both(recommending):
    spec = LoadSpec(str(recommending), mode="baseline")
    flags = SamplingDefaults(temperature=0.0, source="--default-*")
    with live_server(spec, Limits(sampling=flags)) as (url, _):
        unset = chat(url), message(url)
        greedy = chat(url, temperature=0.0), message(url, temperature=0.0)
        asked = chat(url, temperature=1.8, top_p=0.97, top_k=40)
    assert unset == greedy
    assert asked != greedy[0]


@pytest.mark.parametrize(
    "flag, said",
    [
        (["--default-temperature", "3"], "--default-temperature 3.0 is not a number in [0, 2]"),
        (["--default-top-p", "0"], "--default-top-p 0.0 is not a number in (0, 1]"),
        (["--default-top-k", "-1"], "--default-top-k -1 is not a whole number >= 0"),
    ],
)
def test_out_of_range_flags_are_one_line(flag, said):
    result = invoke("serve", "--no-model", "--port", "1", *flag)
    assert result.exit_code != 0 and said in result.output


def test_serve_says_at_start_up_what_unset_sampling_becomes():
    from outrider.server.command import sampling_note

    assert "decode greedily" in sampling_note(SamplingDefaults())
    said = sampling_note(SamplingDefaults(0.6, 0.95, 20, source="generation_config.json"))
    assert said == (
        "note: requests that set no sampling use temperature 0.6, top_p 0.95, top_k 20 "
        "(generation_config.json)"
    )
