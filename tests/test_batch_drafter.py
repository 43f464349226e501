"""Block drafters (DSpark, DFlash) draft every row of a batch in one drafter call per round, and
each row still drafts exactly what it drafts alone.

Rows of different prompt lengths join a running batch at different rounds and leave it at
different rounds; every row's steps (its drafts round by round, what was accepted, what was
committed) must equal those of the same row decoded alone (`decode`, a batch of one). Greedy
and sampled rows (each with its own key stream) share rounds; lookup copies (lookup_assist.py)
replace some rows' drafts; the confidence cut stays per row. A head whose layers slide over a
window (NVIDIA's packaging) sees in a batch exactly the positions it sees alone, though a
batched row's context columns are not in position order.
"""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import pytest
from conftest import PROMPTS

import outrider
from outrider.core.batch import Batch, fork
from outrider.core.device import PIPELINE_ENV
from outrider.core.loop import begin_row, decode, prefill
from outrider.core.proposer import DraftContext
from outrider.core.round import verify_round
from outrider.core.sampling import KeyStream, SamplingParams
from outrider.core.stopping import Stopper
from outrider.testing import make_tiny_drafter

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pipes(qwen3_target, drafters, tmp_path_factory):
    target = str(qwen3_target)
    dspark, dflash = str(drafters["dspark"]), str(drafters["dflash-zlab"])
    # NVIDIA's packaging ships its head in NVFP4 over bfloat16. Off the CPU a row drafted
    # alone and in a batch runs other kernels: MLX's CUDA backend multiplies fewer than 8 rows
    # of a quantized layer with another kernel than 8 or more (docs/testing-on-gpu.md, run
    # 13), and attends one unmasked query row with its vector kernel but a padded batch with
    # its masked fallback. In bfloat16 (8 bits of mantissa) the two round far enough apart to
    # break a random head's near-ties (run 14: two of these tests parted on an H100 with the
    # head unquantized, still bfloat16). These tests are about what the window keeps, so off
    # the CPU the head is the same one in float32 (NVFP4 itself: test_formats_nvidia.py).
    on_cpu = mx.default_device() == mx.cpu
    window = make_tiny_drafter(
        tmp_path_factory.mktemp("window") / "d", qwen3_target, "dspark", "nvidia", window=6,
        nvfp4=on_cpu, dtype="bfloat16" if on_cpu else "float32",
    )  # fmt: skip
    return {
        "dspark-window": outrider.load(target, str(window), mode="dspark", lookup_drafts=False),
        # the drafter sees its latest 10 context rows (--drafter-window)
        "dspark-limited": outrider.load(
            target, dspark, mode="dspark", lookup_drafts=False, drafter_window=10
        ),
        "dspark": outrider.load(target, dspark, mode="dspark"),
        "dflash": outrider.load(target, dflash, mode="dflash"),
        "dspark-confidence": outrider.load(target, dspark, mode="dspark", confidence_threshold=0.3),
        "dspark-bare": outrider.load(target, dspark, mode="dspark", lookup_drafts=False),
    }


def prompts(pipe) -> list[list[int]]:
    """Four rows of different lengths (the last is the first, repeated)."""
    ids = [pipe.encode(p) for p in PROMPTS]
    return [*ids, ids[0] + ids[0][1:] * 3]


def seen(step) -> tuple:
    return step.source, step.drafted, step.accepted, step.committed, step.finish_reason


def alone(pipe, ids: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[tuple]:
    """Every step of `ids` decoded on its own, by a fresh fork of the pipeline's proposer."""
    proposer = fork(pipe.proposer)
    stopper = Stopper(n, set())
    return [seen(s) for s in decode(pipe.target, proposer, ids, stopper, sampling, pipe.max_draft)]


def drafting(row):
    """A row's block proposer (inside the lookup-drafts wrapper, where there is one)."""
    return getattr(row.proposer, "inner", row.proposer)


def make_row(pipe, ids: list[int], n: int, sampling: SamplingParams = GREEDY):
    """A prefilled row (as `Pipeline.start_row` makes it), its one-row cache, its first step."""
    keys = None if sampling.greedy else KeyStream(sampling.seed)
    proposer = fork(pipe.proposer)
    started = prefill(pipe.target, proposer, ids, sampling, keys, [], 0, None)
    row, step = begin_row(
        started, proposer, ids, Stopper(n, set()), sampling, keys, pipe.max_draft, [], 0, None
    )
    return row, started.cache, step


def run_batch(pipe, rows: list[list[int]], lengths, joins, samplings) -> tuple[dict, list]:
    """Rows join a `Batch` at the rounds `joins` says; -> every row's steps, and per round
    (row index, step, whether lookup drafted it) for the rows in it."""
    batch = Batch(pipe.target)
    got: dict[int, list] = {}
    index: dict[int, int] = {}
    joined: list = []  # kept alive: a freed row's id could be reused by a later one
    rounds: list[list] = []
    while len(batch) or len(joined) < len(rows):
        for i, at in enumerate(joins):
            if at == len(rounds):
                row, cache, first = make_row(pipe, rows[i], lengths[i], samplings[i])
                index[id(row)] = i
                joined.append(row)
                got[i] = [seen(first)]
                batch.join(row, cache)
        looked = {id(r): getattr(r.proposer, "lookup_rounds", 0) for r in batch.rows}
        this = []
        for row, step in batch.round():
            got[index[id(row)]].append(seen(step))
            copied = getattr(row.proposer, "lookup_rounds", 0) > looked[id(row)]
            this.append((index[id(row)], step, copied))
        rounds.append(this)
    return got, rounds


LENGTHS = [40, 14, 30, 22]  # rows leave at different rounds
JOINS = [0, 0, 2, 5]  # and join at different rounds


@pytest.mark.parametrize(
    "name", ["dspark", "dflash", "dspark-confidence", "dspark-window", "dspark-limited"]
)
def test_greedy_rows_draft_exactly_what_they_draft_alone(pipes, name):
    pipe = pipes[name]
    rows = prompts(pipe)
    want = [alone(pipe, ids, n) for ids, n in zip(rows, LENGTHS)]
    got, rounds = run_batch(pipe, rows, LENGTHS, JOINS, [GREEDY] * 4)
    for i in range(4):
        assert got[i] == want[i], f"row {i} drafted or committed otherwise in the batch"
    sizes = [len(r) for r in rounds]
    assert max(sizes) == 4 and sizes[-1] == 1  # all four together; the last one alone
    assert any(sum(1 for s in r if s[1].drafted) >= 3 for r in rounds)  # drafted together
    if name == "dspark-confidence":  # the cut differs per row and per round
        cut = {len(s[1].drafted) for r in rounds for s in r if s[1].drafted and not s[2]}
        assert len(cut) > 1


def copying_prompt(pipe) -> list[int]:
    """A prompt whose first round drafts a lookup copy: a row's history up to the round in
    which it copied when decoded alone (greedy decoding goes on from there the same way)."""
    ids = prompts(pipe)[1]
    history = list(ids)
    steps = decode(
        pipe.target, fork(pipe.proposer), ids, Stopper(60, set()), GREEDY, pipe.max_draft
    )
    for step in steps:
        if len(step.drafted) > pipe.max_draft:
            return history[:-1]
        history += step.committed
    raise AssertionError("no lookup copy in 60 tokens")


def test_lookup_copies_and_drafter_drafts_share_rounds(pipes):
    """A row whose round is a lookup copy (the drafter still takes in its context) shares the
    drafter call with rows the drafter drafts for; every row drafts what it drafts alone."""
    pipe = pipes["dspark"]
    rows = [copying_prompt(pipe), *prompts(pipe)[:3]]
    lengths = [24, 30, 16, 24]
    want = [alone(pipe, ids, n) for ids, n in zip(rows, lengths)]
    got, rounds = run_batch(pipe, rows, lengths, [0, 0, 0, 1], [GREEDY] * 4)
    for i in range(4):
        assert got[i] == want[i], f"row {i} drafted or committed otherwise in the batch"
    mixed = [
        r for r in rounds if any(s[2] for s in r) and any(s[1].drafted and not s[2] for s in r)
    ]
    assert mixed and mixed[0] == rounds[0]  # the first row copies in the first round


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_sampled_rows_draft_exactly_what_they_draft_alone(pipes, name):
    """Each sampled row drafts and accepts with its own keys, as alone; greedy rows ride in
    the same rounds."""
    pipe = pipes[name]
    rows = prompts(pipe)
    samplings = [
        SamplingParams(0.9, 0.95, 0, 11),
        GREEDY,
        SamplingParams(0.7, 1.0, 20, 5),
        SamplingParams(1.0, 0.9, 0, 11),  # the seed of row 0, another prompt
    ]
    want = [alone(pipe, ids, n, s) for ids, n, s in zip(rows, LENGTHS, samplings)]
    got, rounds = run_batch(pipe, rows, LENGTHS, JOINS, samplings)
    for i in range(4):
        assert got[i] == want[i], f"row {i} drafted or committed otherwise in the batch"
    assert max(len(r) for r in rounds) == 4
    assert got[0] != got[3]


def test_one_drafter_call_per_round_for_the_whole_batch(pipes, monkeypatch):
    """Counted by the drafter's own call counter: one call per round whatever the number of
    drafting rows, none when no row drafts; a single generation is a batch of one (its rounds
    unpipelined here: a block drafted ahead for a round that is then dropped is a call of its
    own, test_pipelined_rounds.py)."""
    monkeypatch.setenv(PIPELINE_ENV, "off")
    pipe = pipes["dspark-bare"]
    drafter = pipe.proposer.drafter
    rows = prompts(pipe)
    batch = Batch(pipe.target)
    for ids in rows:
        row, cache, _ = make_row(pipe, ids, 24)
        batch.join(row, cache)
    per_round, drafting = [], []
    while len(batch):
        before = drafter.forwards
        steps = batch.round()
        per_round.append(drafter.forwards - before)
        drafting.append(sum(1 for _, s in steps if s.drafted))
    assert per_round == [1 if n else 0 for n in drafting]
    assert max(drafting) == 4 and sum(per_round) < sum(drafting)

    before = drafter.forwards
    steps = alone(pipe, rows[0], 24)
    assert drafter.forwards - before == sum(1 for s in steps if s[1])


@pytest.mark.parametrize(
    "name",  # the windowed rows move between groups in the greedy batch test too
    ["dspark"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ("dspark-window", "dspark-limited")],
)
def test_a_row_moves_its_context_into_and_out_of_a_batch(pipes, name):
    """Row a drafts alone for three rounds, then joins row b's rows (its drafter context moves
    in); later b leaves and goes on alone (its context moves out) while a stays batched.
    Both draft round by round exactly what they draft alone."""
    pipe = pipes[name]
    target = pipe.target
    a, b = prompts(pipe)[3], prompts(pipe)[1]
    n = 48
    want_a, want_b = alone(pipe, a, n), alone(pipe, b, n)
    row_a, cache_a, first = make_row(pipe, a, n)
    got_a = [seen(first)]
    for _ in range(3):
        got_a += [seen(s) for s in verify_round(target, [row_a], cache_a)]
    drafter_rows = drafting(row_a)._group.context
    assert drafter_rows.lengths[0] > len(a)  # a holds context of its own rounds
    row_b, cache_b, first = make_row(pipe, b, n)
    got_b = [seen(first)]
    cache = target.merge_rows([cache_b, cache_a])
    for _ in range(4):
        steps = verify_round(target, [row_b, row_a], cache)
        got_b.append(seen(steps[0]))
        got_a.append(seen(steps[1]))
    assert not row_a.done and not row_b.done
    assert drafting(row_a)._group is drafting(row_b)._group  # one drafter batch
    cache_b = target.extract_row(cache, 0)
    target.filter_rows(cache, [1])
    while not (row_a.done and row_b.done):
        if not row_b.done:
            got_b += [seen(s) for s in verify_round(target, [row_b], cache_b)]
        if not row_a.done:
            got_a += [seen(s) for s in verify_round(target, [row_a], cache)]
    assert drafting(row_a)._group is not drafting(row_b)._group
    assert got_a == want_a
    assert got_b == want_b


@pytest.mark.parametrize("name", ["dspark-bare", "dspark-window", "dspark-limited"])
def test_padded_rows_draft_what_they_draft_apart(pipes, name):
    """Rows holding different amounts of context, taking in different amounts a round, draft
    together what each drafts on its own: padding is masked and every row is roped at its own
    positions (and a window keeps what it keeps by position)."""
    pipe = pipes[name]
    inner = pipe.proposer
    dims = len(inner.spec.target_layer_ids) * inner.spec.hidden_size
    taps = mx.random.normal((40, dims), key=mx.random.key(3))
    cuts = [(0, 7), (7, 19), (19, 20), (20, 40)]  # prompts of different lengths
    rows = [fork(inner) for _ in cuts]
    apart = [fork(inner) for _ in cuts]
    for p, q, (lo, hi) in zip(rows, apart, cuts):
        p.start([1], taps[lo:hi])
        q.start([1], taps[lo:hi])
    for step in range(4):
        ctxs = [DraftContext([5 + i, 9 + step], 2 + i, GREEDY) for i in range(len(rows))]
        together = inner.propose_rows(rows, ctxs)
        for p, q, c in zip(together, apart, ctxs):
            assert p.tokens.tolist() == q.propose(c).tokens.tolist()
        assert [p.k for p in together] == [2, 3, 4, 5]  # each its own cap
        for i, (p, q) in enumerate(zip(rows, apart)):
            verified = taps[i : i + 1 + (i + step) % 3]  # 1 to 3 rows a round
            p.observe(0, verified)
            q.observe(0, verified)
    group = rows[0]._group
    assert all(r._group is group for r in rows) and max(group.context.pads) > 0


def test_a_finished_row_goes_with_its_drafter_context(pipes):
    """A row that left the batch and is dropped frees its proposer at once (no reference
    cycle waits for the collector), and the next call drops its row of drafter context."""
    pipe = pipes["dspark-bare"]
    batch = Batch(pipe.target)
    rows = [make_row(pipe, ids, n)[:2] for ids, n in zip(prompts(pipe), [4, 30, 30])]
    for row, cache in rows:
        batch.join(row, cache)
    first = weakref.ref(rows[0][0].proposer)
    batch.round()
    group = rows[1][0].proposer._group  # the batch's drafter rows
    gc.disable()
    try:
        while len(batch) == 3:
            batch.round()
        assert rows[0][0].done and len(group.context) == 3  # left the batch, row still held
        del rows[0]
        assert first() is None
        batch.round()
    finally:
        gc.enable()
    assert rows[0][0].proposer._group is group and len(group.context) == 2
