"""Rows decoding together give each row exactly what it gives alone.

Batched rounds (core/batch.py) share one target forward across rows of different lengths,
different draft counts and different finishing rounds; each row's cache is rolled back by its
own rejections (plugins/targets/batched.py). Every check here compares a batched row with the
same prompt generated alone, which the lossless suites compare with plain decoding.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core.batch import Batch, fork
from outrider.core.errors import UnsupportedTargetError
from outrider.core.logits import Penalties
from outrider.core.loop import begin_row, prefill
from outrider.core.proposer import DraftContext, Proposal
from outrider.core.sampling import SamplingParams
from outrider.core.stopping import Stopper
from outrider.testing import make_tiny_target

MODES = [("dspark", "dspark"), ("dflash", "dflash-zlab"), ("lookup", None), ("baseline", None)]


@pytest.fixture(scope="module")
def pipes(qwen3_target, drafters):
    return {
        mode: outrider.load(str(qwen3_target), name and str(drafters[name]), mode=mode)
        for mode, name in MODES
    }


def prompts(pipe) -> list[list[int]]:
    """Four rows of different lengths, one of them repetitive (lookup drafts long there)."""
    ids = [pipe.encode(p) for p in PROMPTS]
    return [*ids, ids[0] + ids[0][1:] * 3]


def alone(pipe, rows: list[list[int]], **kwargs) -> list:
    return [pipe.generate(ids, **kwargs) for ids in rows]


@pytest.mark.parametrize(
    "mode", ["dspark", pytest.param("dflash", marks=pytest.mark.slow), "lookup", "baseline"]
)
def test_greedy_rows_match_each_row_alone(pipes, qwen3_target, mode):
    pipe = pipes[mode]
    rows = prompts(pipe)
    kwargs = dict(max_tokens=24, stop_tokens=set())
    batch = pipe.generate_batch(rows, **kwargs)
    singles = alone(pipe, rows, **kwargs)
    assert [r.tokens for r in batch] == [r.tokens for r in singles]
    assert batch[1].tokens == plain_greedy(qwen3_target, rows[1], 24)


class RowOracle:
    """Drafts each row's known greedy continuation, a random number of tokens a round with a
    wrong token now and then (seeded by the row's prompt, so a row drafts the same alone and
    batched): rows of one round draft and accept different counts."""

    name = "oracle"
    tap_layer_ids: tuple[int, ...] = ()
    max_draft = 6

    def __init__(self, references: dict[tuple, list[int]], vocab: int) -> None:
        self.references, self.vocab = references, vocab

    def start(self, prompt: list[int], taps) -> None:
        self.reference = self.references[tuple(prompt)]
        self.rng = random.Random(len(prompt))

    def propose(self, ctx: DraftContext) -> Proposal:
        m = len(ctx.tokens)
        k = self.rng.randint(0, ctx.cap)
        truth = self.reference[m : m + k]
        drafts = [t if self.rng.random() < 0.75 else (t + 1) % self.vocab for t in truth]
        return Proposal(mx.array(drafts, dtype=mx.uint32), len(drafts))  # drafts on the device

    def observe(self, accepted: int, taps) -> None:
        pass


def test_rows_accepting_different_counts_match_each_row_alone(pipes, qwen3_target):
    """Rows draft 0..6 tokens and accept different counts in the same rounds: padding and
    per-row rollback are exercised every round."""
    plain = pipes["baseline"]
    rows = prompts(plain)
    refs = {tuple(ids): ids + plain_greedy(qwen3_target, ids, 48) for ids in rows}
    oracle = RowOracle(refs, plain.target.config["vocab_size"])
    pipe = outrider.Pipeline(plain.target, oracle, "oracle", 6)
    batch = pipe.generate_batch(rows, max_tokens=48, stop_tokens=set())
    for ids, result in zip(rows, batch):
        assert result.tokens == refs[tuple(ids)][len(ids) :]
    accepted = [[r.accepted for r in result.rounds] for result in batch]
    assert len({tuple(a[:5]) for a in accepted}) == len(rows)  # rows differ round by round
    assert any(r.accepted >= 3 for result in batch for r in result.rounds)


def test_rows_finish_at_different_rounds(pipes):
    """A row that stops early leaves; the others go on unchanged."""
    pipe = pipes["lookup"]
    rows = prompts(pipe)
    first = pipe.generate(rows[0], max_tokens=30, stop_tokens=set()).tokens
    kwargs = dict(max_tokens=30, stop_tokens={first[7]})  # row 0 stops at its 8th token
    batch = pipe.generate_batch(rows, **kwargs)
    singles = alone(pipe, rows, **kwargs)
    assert [(r.tokens, r.finish_reason) for r in batch] == [
        (r.tokens, r.finish_reason) for r in singles
    ]
    assert batch[0].finish_reason == "stop" and len(batch[0].tokens) < 30


def test_a_batched_rounds_steps_say_where_its_seconds_went(pipes):
    """Each step of a batched round carries the round's phases (launch, wait, after), which
    add up to its seconds: what benchmarks/batch_timeline.py reads inside the real loop."""
    pipe = pipes["dspark"]
    batch = Batch(pipe.target)
    for ids in prompts(pipe)[:3]:
        row, cache, _ = _row(pipe, ids, 12)
        batch.join(row, cache)
    steps = batch.round()
    assert len(steps) == 3
    for _, step in steps:
        assert set(step.phases) == {"launch", "wait", "after"}
        assert all(v >= 0 for v in step.phases.values())
        assert sum(step.phases.values()) == pytest.approx(step.seconds, abs=1e-6)


def test_rows_join_as_others_finish_under_a_width_limit(pipes):
    """With `max_batch`, the waiting prompts join the rounds a row leaves (continuous
    batching, as the server runs it): every row still gets what it gets alone, and no round
    is wider than the limit."""
    pipe = pipes["dspark"]
    rows = prompts(pipe)
    first = pipe.generate(rows[0], max_tokens=20, stop_tokens=set()).tokens
    kwargs = dict(max_tokens=20, stop_tokens={first[4]})  # row 0 leaves early, row 2 joins
    widths = []
    make_batch = pipe.make_batch

    def watched_batch():
        batch = make_batch()
        run = batch.round
        batch.round = lambda: (widths.append(len(batch)), run())[1]
        return batch

    pipe.make_batch = watched_batch
    try:
        batch = pipe.generate_batch(rows, max_batch=2, **kwargs)
    finally:
        del pipe.make_batch
    singles = alone(pipe, rows, **kwargs)
    assert [(r.tokens, r.finish_reason) for r in batch] == [
        (r.tokens, r.finish_reason) for r in singles
    ]
    assert max(widths) == 2 and widths.count(2) > len(widths) // 2
    assert sum(len(r.rounds) for r in batch) == sum(widths)  # every row ran in some round
    with pytest.raises(outrider.OutriderError, match="max_batch"):
        pipe.generate_batch(rows, max_batch=0)


@pytest.mark.parametrize("mode", ["dspark", "lookup", "baseline"])
def test_sampled_rows_match_each_row_alone(pipes, mode):
    """Each row draws from its own key stream, as it would alone: the same seed gives the
    same tokens, penalties and log-probabilities included."""
    pipe = pipes[mode]
    rows = prompts(pipe)[:3]
    kwargs = dict(
        max_tokens=24,
        stop_tokens=set(),
        temperature=0.9,
        top_p=0.95,
        seed=11,
        penalties=Penalties(presence=0.5, frequency=0.2),
        logprobs=2,
    )
    batch = pipe.generate_batch(rows, **kwargs)
    singles = alone(pipe, rows, **kwargs)
    assert [r.tokens for r in batch] == [r.tokens for r in singles]


def _row(pipe, ids, max_tokens, cancelled=None):
    sampling = SamplingParams()
    proposer = fork(pipe.proposer)
    started = prefill(pipe.target, proposer, ids, sampling, None, [], 0, None)
    stopper = Stopper(max_tokens, set())
    row, step = begin_row(
        started, proposer, ids, stopper, sampling, None, pipe.max_draft, [], 0, None,
        cancelled=cancelled,
    )  # fmt: skip
    return row, started.cache, list(step.committed)


def test_rows_join_and_leave_between_rounds(pipes):
    """Continuous batching: rows join a running batch at round boundaries, one is cancelled
    mid-flight, and every other row still gets exactly its own output."""
    pipe = pipes["dspark"]
    rows = prompts(pipe)
    want = [r.tokens for r in alone(pipe, rows, max_tokens=36, stop_tokens=set())]
    stop_row_2 = []
    got: dict[int, list[int]] = {}
    batch = Batch(pipe.target)
    made = {}
    joined: list = []

    def join(i: int) -> None:
        row, cache, first = _row(pipe, rows[i], 36, (lambda: bool(stop_row_2)) if i == 2 else None)
        made[id(row)] = i
        joined.append(row)  # kept alive: a freed row's id could be reused by a later one
        got[i] = first
        batch.join(row, cache)

    join(0)
    rounds = 0
    while len(batch) or len(joined) < len(rows):
        if rounds == 2:
            join(1)
            join(2)
        if rounds == 4:
            join(3)
        if rounds == 5:
            stop_row_2.append(True)
        for row, step in batch.round():
            got[made[id(row)]] += step.committed
        rounds += 1
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    assert got[2] == want[2][: len(got[2])] and len(got[2]) < 36  # cancelled, a prefix


def test_rolled_back_rows_hold_exactly_their_own_positions(qwen3_target):
    """After a shared forward, row i dropping n[i] positions leaves keys and values equal to a
    one-row cache fed only that row's kept tokens."""
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    target = pipe.target
    a, b = [3, 4, 5, 6, 7, 8, 9], [10, 11, 12]
    caches = []
    for ids in (a, b):
        cache = target.make_cache()
        target.forward(mx.array(ids, dtype=mx.uint32), cache)
        caches.append(cache)
    batched = target.merge_rows(caches)
    block = [[20, 21, 22, 23], [30, 31, 32, 33]]
    target.forward_rows(mx.array(block, dtype=mx.uint32), batched)
    target.rollback_rows(batched, [3, 1])  # row 0 keeps 1 of 4, row 1 keeps 3
    target.forward_rows(mx.array([[40], [41]], dtype=mx.uint32), batched)
    for i, kept in enumerate([a + [20, 40], b + [30, 31, 32, 41]]):
        alone_cache = target.make_cache()
        target.forward(mx.array(kept, dtype=mx.uint32), alone_cache)
        row = target.extract_row(batched, i)
        for mine, theirs in zip(row, alone_cache):
            assert mine.offset == theirs.offset == len(kept)
            k1, k2 = mine.state[0], theirs.state[0][..., : len(kept), :]
            assert mx.allclose(k1, k2, atol=1e-5).item()


def test_a_rollback_that_moves_columns_writes_the_buffers_in_place(qwen3_target):
    """Rows rejecting different counts move columns inside each layer's K/V buffer. The moved
    columns are read before any is written, so MLX updates the buffers in place; a write whose
    value still read its own buffer made it copy every layer's whole buffer, every round (at
    8 rows of a long context, gigabytes a round). Peak memory tells the two apart."""
    target = outrider.load(str(qwen3_target), mode="baseline").target
    prompts = [[3 + i % 50 for i in range(n)] for n in (900, 700)]
    caches = []
    for ids in prompts:
        cache = target.make_cache()
        target.forward(mx.array(ids, dtype=mx.uint32), cache)
        caches.append(cache)
    batched = target.merge_rows(caches)
    target.forward_rows(mx.array([[20, 21, 22, 23], [30, 31, 32, 33]], dtype=mx.uint32), batched)
    mx.eval([c.state[:2] for c in batched])
    buffers = sum(c.keys.nbytes + c.values.nbytes for c in batched)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    target.rollback_rows(batched, [3, 1])  # row 0 moves two columns
    mx.eval([c.state[:2] for c in batched])
    grew = mx.get_peak_memory() - before
    assert grew < buffers / 10, (grew, buffers)  # a copy would take all of `buffers` again
    kept = prompts[0] + [20]
    alone = target.make_cache()
    target.forward(mx.array(kept, dtype=mx.uint32), alone)
    mine = target.extract_row(batched, 0)[0].state[0]
    assert mx.allclose(mine, alone[0].state[0][..., : len(kept), :], atol=1e-5).item()


def uneven_rounds(target, lengths: list[int], rounds: int, seed: int, close) -> tuple:
    """Rows of random prompts of `lengths`, merged into one batch, then `rounds` rounds of
    random widths, each row rejecting its own count (so rows move their oldest columns into
    their rejected slots); halfway, row 1 leaves and a row of 11 tokens joins. Each round's
    logits of every row are checked against that row alone with `close(batched, alone)`.
    Returns (every row's kept tokens, the batched cache)."""
    rng = random.Random(seed)
    vocab = int(target.config["vocab_size"])
    ids = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    history, caches = [], []
    for n in lengths:
        history.append(ids(n))
        caches.append(target.make_cache())
        target.forward(mx.array(history[-1], dtype=mx.uint32), caches[-1])
    batched = target.merge_rows(caches)
    for round_ in range(rounds):
        width = rng.randrange(1, 7)
        block = [ids(width) for _ in history]
        logits, _ = target.forward_rows(mx.array(block, dtype=mx.uint32), batched)
        rejected = [rng.randrange(0, width) for _ in history]
        for i, row in enumerate(history):
            alone, _ = target.forward(
                mx.array(row + block[i], dtype=mx.uint32), target.make_cache()
            )
            want = alone[-width:]
            assert close(logits[i], want), (  # the round, the row, and by how much
                round_,
                i,
                (mx.abs(logits[i] - want).max() / mx.abs(want).max()).item(),
            )
            history[i] = row + block[i][: width - rejected[i]]
        target.rollback_rows(batched, rejected)
        if round_ == rounds // 2 - 1:
            target.filter_rows(batched, [i for i in range(len(history)) if i != 1])
            history.pop(1)
            history.append(ids(11))
            joining = target.make_cache()
            target.forward(mx.array(history[-1], dtype=mx.uint32), joining)
            target.extend_rows(batched, target.merge_rows([joining]))
    return history, batched


def test_uneven_rollbacks_keep_every_row_what_it_holds_alone(qwen3_target):
    """Rounds of random widths, each row rejecting its own count, a row leaving and one
    joining: every round's logits are each row's alone, and a row taken out holds its tokens
    in order, so a one-row rollback after that drops its newest tokens."""
    target = outrider.load(str(qwen3_target), mode="baseline").target
    close = lambda a, b: mx.allclose(a, b, atol=1e-4).item()  # noqa: E731
    history, batched = uneven_rounds(target, [5, 9, 14, 20], 12, 3, close)
    for i, row in enumerate(history):
        mine = target.extract_row(batched, i)
        target.rollback(mine, 2)
        alone = target.make_cache()
        target.forward(mx.array(row[:-2], dtype=mx.uint32), alone)
        for got, want in zip(mine, alone):
            assert got.offset == want.offset == len(row) - 2
            keys = got.state[0][..., : got.offset, :]
            assert mx.allclose(keys, want.state[0][..., : want.offset, :], atol=1e-5).item()


def test_llama_rows_match_each_row_alone(llama_target):
    pipe = outrider.load(str(llama_target), mode="lookup")
    rows = prompts(pipe)[:3]
    batch = pipe.generate_batch(rows, max_tokens=24, stop_tokens=set())
    assert [r.tokens for r in batch] == [
        r.tokens for r in alone(pipe, rows, max_tokens=24, stop_tokens=set())
    ]


def test_a_family_without_batched_caches_is_refused(fallback_target):
    # cohere2 has no family plugin: the dense family declines its rotating caches and the
    # mlx-lm fallback runs it, one row at a time
    path = fallback_target
    pipe = outrider.load(str(path), mode="baseline")
    assert pipe.target.family.name == "mlx_lm"
    one = pipe.generate([1, 2, 3], max_tokens=12, stop_tokens=set())
    assert one.tokens == plain_greedy(path, [1, 2, 3], 12)
    with pytest.raises(UnsupportedTargetError, match="one row at a time"):
        pipe.generate_batch([[1, 2, 3]], max_tokens=4)


@pytest.mark.parametrize(
    "family", ["qwen3_5", "lfm2", pytest.param("nemotron_h", marks=pytest.mark.slow)]
)
def test_recurrent_rows_accepting_different_counts_match_each_row_alone(tmp_path, family):
    """Hybrids batch too: each row's recurrent state replays its own accepted prefix."""
    path = make_tiny_target(tmp_path / family, family=family)
    plain = outrider.load(str(path), mode="baseline")
    rows = prompts(plain)
    refs = {tuple(ids): ids + plain_greedy(path, ids, 32) for ids in rows}
    batch = plain.generate_batch(rows, max_tokens=32, stop_tokens=set())
    assert [r.tokens for r in batch] == [refs[tuple(ids)][len(ids) :] for ids in rows]
    oracle = RowOracle(refs, plain.target.config["vocab_size"])
    pipe = outrider.Pipeline(plain.target, oracle, "oracle", 6)
    batch = pipe.generate_batch(rows, max_tokens=32, stop_tokens=set())
    for ids, result in zip(rows, batch):
        assert result.tokens == refs[tuple(ids)][len(ids) :]
    assert any(0 < r.accepted < len(r.drafted) for res in batch for r in res.rounds)
