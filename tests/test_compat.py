"""mlx-dspark's Python API (outrider.compat) on the embedded demo pair: reference scripts run
unchanged and produce outrider's (lossless) output."""

from __future__ import annotations

import sys

import pytest

from outrider import compat
from outrider.api import load
from outrider.core.errors import OutriderError

DEMO = "outrider-demo/target"
PROMPT = "def parse("

# The reference README's Python block, word for word except the model name.
README_DSPARK = """
from mlx_dspark import load_pair, speculative_generate

target, tok, drafter, cfg = load_pair("outrider-demo/target")   # drafter auto-resolved
res = speculative_generate(target, tok, drafter, "def parse(")
print(res.text, res.mean_accept_len, res.tokens_per_sec)
"""
README_DFLASH = """
from mlx_dspark import load_dflash_pair, dflash_generate   # z-lab DFlash instead

target, tok, drafter, cfg = load_dflash_pair("outrider-demo/target")
res = dflash_generate(target, tok, drafter, "def parse(")  # max_draft_tokens=None = full block
print(res.text, res.mean_accept_len, res.tokens_per_sec)
"""


@pytest.fixture(scope="session")  # kept across modules: built once a worker
def dspark():
    return compat.load_pair(DEMO)


@pytest.fixture(scope="session")  # kept across modules: built once a worker
def baseline_tokens():
    return load(DEMO, mode="baseline").generate(PROMPT, max_tokens=128).tokens


def run_script(source: str, monkeypatch) -> dict:
    monkeypatch.setitem(sys.modules, "mlx_dspark", compat)
    scope: dict = {}
    exec(compile(source, "reference_readme.py", "exec"), scope)
    return scope


def test_reference_readme_script_runs_unchanged(monkeypatch, capsys, baseline_tokens):
    scope = run_script(README_DSPARK, monkeypatch)
    res = scope["res"]
    assert res.token_ids == baseline_tokens  # lossless: the target's own greedy output
    assert res.num_tokens == len(baseline_tokens) and res.num_rounds > 0
    assert res.mean_accept_len > 1.0 and res.tokens_per_sec > 0
    assert max(len(r.drafted) for r in res.result.rounds) <= 2  # the reference's library cap
    assert scope["drafter"].kind == "dspark" and scope["cfg"].kind == "dspark"
    printed = capsys.readouterr().out
    assert printed.startswith(res.text) and f"{res.mean_accept_len}" in printed


def test_reference_dflash_script_drafts_the_full_block(monkeypatch, baseline_tokens):
    scope = run_script(README_DFLASH, monkeypatch)
    res, full = scope["res"], scope["drafter"].pipeline.proposer.max_draft
    assert res.token_ids == baseline_tokens
    assert max(len(r.drafted) for r in res.result.rounds) == full > 2


def test_result_fields_add_up(dspark):
    target, tok, drafter, _ = dspark
    res = compat.speculative_generate(
        target, tok, drafter, PROMPT, max_new_tokens=20, max_draft_tokens=None
    )
    assert res.num_tokens == len(res.token_ids) == 20 and res.finish_reason == "length"
    assert sum(res.accept_lengths) + 1 == res.num_tokens  # the first token is the prefill's
    assert res.target_forwards == res.num_rounds + 1
    assert 0 < res.prefill_seconds < res.seconds
    assert res.decode_seconds == pytest.approx(res.seconds - res.prefill_seconds)
    assert res.tokens_per_sec == pytest.approx(20 / res.seconds)
    assert res.lookup_rounds == 0 and res.logprobs is None and res.prompt_tokens > 0


def test_on_text_streams_and_stop_streaming_ends_early(dspark):
    target, tok, drafter, _ = dspark
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise compat.StopStreaming

    res = compat.speculative_generate(target, tok, drafter, PROMPT, on_text=on_text)
    assert len(pieces) == 3 and res.text == "".join(pieces)
    assert 0 < res.num_tokens < 128 and res.result is None


def test_confidence_threshold_reuses_the_target(dspark, baseline_tokens):
    target, tok, drafter, _ = dspark
    res = compat.speculative_generate(target, tok, drafter, PROMPT, confidence_threshold=0.5)
    assert res.token_ids == baseline_tokens
    assert drafter.at_threshold(0.5).target is target
    assert drafter.at_threshold(0.5).options["confidence_threshold"] == 0.5


def test_speed_knobs_accepted_state_knobs_refused(dspark):
    target, tok, drafter, _ = dspark
    res = compat.speculative_generate(
        target, tok, drafter, PROMPT, max_new_tokens=4, lookup_drafts=False, cap_controller=None
    )
    assert res.num_tokens == 4
    with pytest.raises(TypeError, match="enable_prefix_cache"):
        compat.speculative_generate(target, tok, drafter, PROMPT, cache=object())
    with pytest.raises(TypeError, match="nonsense"):
        compat.speculative_generate(target, tok, drafter, PROMPT, nonsense=1)


def test_think_budget_closes_the_thinking_as_pipeline_stream_does(dspark):
    target, tok, drafter, _ = dspark
    ids = compat.encode_prompt(tok, PROMPT) + [tok.get_vocab()["<think>"]]
    res = compat.speculative_generate(
        target, tok, drafter, prompt_ids=ids, max_new_tokens=40, think_budget=0,
        budget_message="Enough.",
    )  # fmt: skip
    want = drafter.pipeline.generate(
        ids, max_tokens=40, reasoning_budget=0, budget_message="Enough.", max_draft=2
    )
    assert res.budget_forced and res.token_ids == want.tokens
    assert "Enough.\n</think>" in tok.decode(res.token_ids)


def test_mismatched_parts_are_refused(dspark):
    target, tok, drafter, _ = dspark
    with pytest.raises(OutriderError, match="dspark pair; use speculative_generate"):
        compat.dflash_generate(target, tok, drafter, PROMPT)
    with pytest.raises(OutriderError, match="another target"):
        compat.speculative_generate(object(), tok, drafter, PROMPT)
    with pytest.raises(OutriderError, match="load_pair"):
        compat.speculative_generate(target, tok, "a drafter", PROMPT)


def test_legacy_aliases_name_registry_targets():
    assert compat._model_ref("gemma4") == "google/gemma-4-12b-it"
    assert compat._model_ref("qwen3") == "Qwen/Qwen3-4B"
    assert compat._model_ref(DEMO) == DEMO


def test_greedy_and_lookup_loops_and_the_encoders(baseline_tokens):
    """mlx-dspark's drafter-free loops over `load_target`'s target: `greedy_generate` is the
    target's plain decoding, `lookup_generate` the same tokens from n-gram rounds (at most
    `max_draft_tokens` drafts a round); the encoders are the chat template's ids."""
    target, tok = compat.load_target(DEMO)
    plain = compat.greedy_generate(target, tok, PROMPT)
    assert plain.token_ids == baseline_tokens and plain.num_rounds == 0
    looked = compat.lookup_generate(target, tok, PROMPT, max_draft_tokens=3, ngram_min=3)
    assert looked.token_ids == baseline_tokens and looked.num_rounds > 0
    assert max(len(r.drafted) for r in looked.result.rounds) <= 3
    messages = [{"role": "user", "content": PROMPT}]
    assert compat.encode_messages(tok, messages) == compat.encode_prompt(tok, PROMPT)
    assert compat.encode_prompt(tok, PROMPT, use_chat=False) == list(tok.encode(PROMPT))
    with pytest.raises(OutriderError, match="load_target"):
        compat.greedy_generate("not a target", tok, PROMPT)
    with pytest.raises(TypeError, match="cache="):
        compat.lookup_generate(target, tok, PROMPT, cache=[])
