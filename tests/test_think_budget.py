"""A reasoning budget (core/think_budget.py): after N thinking tokens the engine closes the
model's thinking for it, at the same position in every mode, in batches, with the prefix
cache, and through the server's APIs; without a think block nothing changes."""

from __future__ import annotations

import pytest
from conftest import plain_greedy

import outrider
from outrider.core.think_budget import DEFAULT_MESSAGE, ThinkBudget, make_budget

OPEN, CLOSE = 1, 2
CLOSING = [7, 8, CLOSE, 9]
MODES = [("baseline", None), ("dspark", "dspark"), ("dflash", "dflash-zlab"), ("lookup", None)]


def budget(limit: int, inside: bool = False) -> ThinkBudget:
    return ThinkBudget(limit, OPEN, CLOSE, list(CLOSING), inside=inside)


def test_counts_only_tokens_inside_the_block_and_fires_once():
    b = budget(3)
    assert b.cut([5, 6, OPEN, 10, 11]) is None  # outside, then two thinking tokens
    assert b.spent == 2
    assert b.cut([12, 13, 14]) == 1  # the third is kept; the fourth gives way
    assert b.take_first() == CLOSING[0] and b.pending == CLOSING[1:]
    assert b.cut([OPEN, 20, 21, 22, 23]) is None  # once a generation


def test_a_closer_the_model_writes_at_the_limit_is_kept():
    b = budget(2, inside=True)
    assert b.cut([10, 11, CLOSE, 12, 13]) is None  # the block ended on its own
    assert not b.fired and not b.inside
    # the budget is the generation's: a second block's first token finds it spent
    assert b.cut([OPEN, 14, 15]) == 1 and b.fired


def test_a_zero_budget_inside_the_prompts_block_fires_at_the_first_token():
    b = budget(0, inside=True)
    assert b.cut([10]) == 0 and b.fired


def test_the_grouping_of_tokens_into_rounds_does_not_move_the_cut():
    text = [3, OPEN, *range(20, 40), CLOSE, 50]
    whole = budget(7)
    at = whole.cut(text)
    for size in (1, 2, 3, 5, 8):
        b, seen, cut = budget(7), 0, None
        for i in range(0, len(text), size):
            got = b.cut(text[i : i + size])
            if got is not None:
                cut = seen + got
                break
            seen += len(text[i : i + size])
        assert cut == at == 9  # 3, <think>, seven thinking tokens kept


class Vocab:
    """A tokenizer with (or without) the think markers as single tokens."""

    def __init__(self, markers: bool) -> None:
        self.markers = markers

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": OPEN, "</think>": CLOSE} if self.markers else {"<think": 5}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [100 + ord(c) for c in text]


def test_make_budget_reads_the_markers_and_whether_the_prompt_opened_a_block():
    made = make_budget(Vocab(True), 5, ("<think>", "</think>"), [3, OPEN], "Done.")
    assert made.inside and made.limit == 5
    assert made.closing == [100 + ord(c) for c in "\n\nDone.\n"] + [CLOSE, 110, 110]
    closed = make_budget(Vocab(True), 5, ("<think>", "</think>"), [3, OPEN, 4, CLOSE])
    assert not closed.inside
    assert make_budget(Vocab(False), 5, ("<think>", "</think>"), [3]) is None
    channels = ("<|message|>", "<|end|>")  # a channel transcript: no block to count in
    assert make_budget(Vocab(True), 5, channels, [3]) is None


def test_gemmas_thought_channel_is_budgeted_by_its_tokens():
    class Gemma(Vocab):
        def get_vocab(self) -> dict[str, int]:
            return {"<|channel>": OPEN, "<channel|>": CLOSE}

    made = make_budget(Gemma(True), 5, ("<|channel>thought", "<channel|>"), [3, OPEN, 50])
    assert made.inside and made.closer == CLOSE and CLOSE in made.closing
    with pytest.raises(ValueError, match=">= 0"):
        make_budget(Vocab(True), -1, ("<think>", "</think>"), [3])


@pytest.fixture(scope="module")
def pipes(qwen3_target, drafters):
    return {
        mode: outrider.load(str(qwen3_target), name and str(drafters[name]), mode=mode)
        for mode, name in MODES
    }


def thinking_prompt(pipe, text: str = "Think about the weather") -> list[int]:
    """A prompt that leaves a think block open (as templates that prefill the opener do)."""
    return pipe.encode(text, raw=True) + [pipe.tokenizer.get_vocab()["<think>"]]


@pytest.mark.parametrize("limit", [0, 6])
def test_plain_decoding_keeps_n_thinking_tokens_then_the_closing(pipes, qwen3_target, limit):
    pipe = pipes["baseline"]
    ids = thinking_prompt(pipe)
    plain = plain_greedy(qwen3_target, ids, 40)
    got = pipe.generate(ids, max_tokens=40, stop_tokens=set(), reasoning_budget=limit)
    closing = pipe.think_budget(ids, limit).closing
    assert pipe.tokenizer.decode(closing) == f"\n\n{DEFAULT_MESSAGE}\n</think>\n\n"
    assert got.budget_forced and got.to_json()["budget_forced"] is True
    assert got.tokens[:limit] == plain[:limit]
    assert got.tokens[limit : limit + len(closing)] == closing
    # the model goes on from the closing as from its own tokens: what follows is its greedy
    # continuation of the prompt, the kept tokens and the closing
    n = limit + len(closing)
    assert got.tokens[n:] == plain_greedy(qwen3_target, ids + got.tokens[:n], 40 - n)


@pytest.mark.parametrize("mode,drafter", MODES[1:])
@pytest.mark.parametrize("cap", [1, 4, "auto"])
def test_every_mode_closes_where_plain_decoding_does(pipes, mode, drafter, cap):
    pipe, base = pipes[mode], pipes["baseline"]
    ids = thinking_prompt(pipe)
    for limit in (0, 3, 11):
        kwargs = dict(max_tokens=36, stop_tokens=set(), reasoning_budget=limit)
        want = base.generate(ids, **kwargs)
        got = pipe.generate(ids, max_draft=cap, **kwargs)
        assert got.tokens == want.tokens, f"{mode} cap {cap} budget {limit}"
        assert got.budget_forced


def test_without_a_think_block_the_budget_changes_nothing(pipes, qwen3_target):
    pipe = pipes["dspark"]
    ids = pipe.encode("Think about the weather", raw=True)
    got = pipe.generate(ids, max_tokens=30, stop_tokens=set(), reasoning_budget=0)
    assert got.tokens == plain_greedy(qwen3_target, ids, 30) and not got.budget_forced


def test_batched_rows_and_the_prefix_cache_close_where_a_row_alone_does(pipes):
    pipe, base = pipes["dspark"], pipes["baseline"]
    rows = [
        thinking_prompt(pipe),
        thinking_prompt(pipe, "A longer prompt, thinking about something else entirely"),
        pipe.encode("No block here", raw=True),
    ]
    kwargs = dict(max_tokens=30, stop_tokens=set(), reasoning_budget=4)
    want = [base.generate(r, **kwargs) for r in rows]
    got = pipe.generate_batch(rows, **kwargs)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.budget_forced for g in got] == [True, True, False]
    pipe.enable_prefix_cache(gb=1)
    try:
        for _ in range(2):  # a miss, then a whole-prompt hit
            assert pipe.generate(rows[0], **kwargs).tokens == want[0].tokens
    finally:
        pipe.prefix_cache = None


def test_sampled_output_is_closed_at_the_same_position(pipes):
    pipe = pipes["dspark"]
    ids = thinking_prompt(pipe)
    closing = pipe.think_budget(ids, 5).closing
    for seed in (1, 2, 3):
        got = pipe.generate(
            ids, max_tokens=40, stop_tokens=set(), temperature=1.0, seed=seed, reasoning_budget=5
        )
        assert got.tokens[5 : 5 + len(closing)] == closing and got.budget_forced


def test_logprobs_of_the_closing_are_the_targets_own(pipes, qwen3_target):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(qwen3_target))
    pipe = pipes["dspark"]
    ids = thinking_prompt(pipe)
    for limit in (0, 4):
        chunks = list(
            pipe.stream(ids, max_tokens=30, stop_tokens=set(), reasoning_budget=limit, logprobs=2)
        )
        got = [lp for c in chunks for lp in c.step.logprobs]
        tokens = [g.token for g in got]
        assert tokens == pipe.generate(ids, max_tokens=30, stop_tokens=set(),
                                       reasoning_budget=limit).tokens  # fmt: skip
        # every token's log-probability, the closing's included (the first of which takes the
        # place of a token the target chose), is the target's after what came before it
        logits = model(mx.array([ids + tokens]))[0, len(ids) - 1 : -1].astype(mx.float32)
        want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for i, g in enumerate(got):
            assert g.logprob == pytest.approx(want[i, g.token].item(), abs=1e-3), i


def test_a_round_queued_ahead_of_the_cut_is_dropped(pipes, monkeypatch):
    """With every round that can go ahead queued (pipelined rounds on), the round behind the
    one the budget cuts ran on tokens that were never committed: it is dropped, and the
    output is plain decoding's with the same budget."""
    from outrider.core.device import PIPELINE_ENV
    from outrider.testing import OracleProposer

    monkeypatch.setenv(PIPELINE_ENV, "on")
    base = pipes["baseline"]
    ids = thinking_prompt(base)
    kwargs = dict(max_tokens=40, stop_tokens=set(), reasoning_budget=9)
    want = base.generate(ids, **kwargs)
    # an oracle of the budgeted answer: its drafts all hold but where the budget cut the
    # target's own choice, so the one round dropped is the one queued behind the cut
    oracle = OracleProposer(ids + want.tokens, 1.0, vocab_size=262, max_draft=8, seed=3)
    pipe = outrider.pipeline_from_parts(base.target, oracle, "oracle", max_draft=4)
    got = pipe.generate(ids, **kwargs)
    assert got.tokens == want.tokens and got.budget_forced
    assert got.pipelining[1] == 1
    dspark = pipes["dspark"]
    dspark.pipelined_rounds = True
    assert dspark.generate(ids, max_draft=3, **kwargs).tokens == want.tokens


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "gemma3_text"])
def test_hybrid_and_sliding_targets_close_where_plain_decoding_does(tmp_path, family):
    """Gated-delta and Mamba-2 states cannot drop a forward queued past the cut: plain
    decoding with a budget runs one-token rounds there, and every cut rolls back through
    the families' own rollback (sliding windows too)."""
    from outrider.testing import make_tiny_target

    path = make_tiny_target(tmp_path / family, family=family)
    base = outrider.load(str(path), mode="baseline")
    look = outrider.load(str(path), mode="lookup")
    ids = thinking_prompt(base, "repeat repeat repeat repeat")
    for limit in (0, 5):
        kwargs = dict(max_tokens=40, stop_tokens=set(), reasoning_budget=limit)
        want = base.generate(ids, **kwargs)
        assert want.budget_forced
        for cap in (1, 4, "auto"):
            assert look.generate(ids, max_draft=cap, **kwargs).tokens == want.tokens
