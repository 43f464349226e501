"""DSpark's prefix scheduler on batched rounds (core/batch_schedule.py `BatchScheduler`): once every row
has drafted, each row verifies only the drafts worth widening the batch's forward for.

The cut looks only at what the drafter knew before each draft (its per-slot confidence, or the
row's running acceptance), so greedy rows stay token-identical to their single-request output
and sampled rows keep the target's distribution; the helper that turns proposals and a
calibrated verify cost into caps is checked on its own.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import PROMPTS
from sampling_check import PARAMS, chi2_critical, chi_square, exact_joint

import outrider
from outrider.core.batch import Batch
from outrider.core.batch_schedule import BatchScheduler, admit, survival
from outrider.core.calibration import Calibration
from outrider.core.proposer import Proposal
from outrider.core.round import _own_keys, verify_round
from outrider.core.sampling import SamplingParams
from outrider.core.schedule import AutoCap, learn_acceptance
from outrider.server.metrics import Metrics

MODES = {"dspark": "dspark", "dflash": "dflash-zlab", "lookup": None}


def curve(per_token: float, widest: int = 16) -> Calibration:
    """A calibration whose one-row verify of w tokens costs 1 + per_token x (w - 1) ms."""
    return Calibration({}, {128: [1.0 + per_token * w for w in range(widest)]})


FLAT, CHEAP, DEAR = curve(0.0), curve(0.01), curve(1.0)


@pytest.fixture(scope="module")
def pipes(qwen3_target, drafters):
    return {
        mode: outrider.load(str(qwen3_target), name and str(drafters[name]), mode=mode)
        for mode, name in MODES.items()
    }


def scheduled(pipe, calibration: Calibration | None):
    """The pipeline with this calibration and a fresh scheduler (None: no calibration)."""
    pipe.calibration, pipe.scheduler, pipe.schedule_batches = calibration, None, True
    return pipe


def prompts(pipe) -> list[list[int]]:
    ids = [pipe.encode(p) for p in PROMPTS]
    return [*ids, ids[0] + ids[0][1:] * 3]


# -- the helper: drafted sizes, confidences and a calibration -> caps ---------------------------


def test_flat_verify_cost_admits_every_draft():
    sched = BatchScheduler(FLAT)
    conf = [[0.9, 0.8, 0.7, 0.6], [0.5, 0.5, 0.5]]
    assert sched.keep([4, 3], [4, 4], conf, [[], []]) == [4, 3]
    assert (sched.rounds, sched.proposed, sched.cut) == (1, 7, 0)


def test_costly_width_verifies_fewer_drafts():
    """Each verified token costs 10% of a one-row step: the confident row widens the forward
    to its two drafts, the unsure row's first two ride in that width for free, and its last
    two (survival 0.006 and less) are not worth widening it again. At 100% a token no draft
    pays."""
    conf = [[0.95, 0.9], [0.3, 0.2, 0.1, 0.1]]
    sched = BatchScheduler(curve(0.1))
    assert sched.keep([2, 4], [4, 4], conf, [[], []]) == [2, 2]
    assert (sched.proposed, sched.cut) == (6, 2)
    dear = BatchScheduler(DEAR)
    assert dear.keep([2, 4], [4, 4], conf, [[], []]) == [0, 0]
    assert dear.cut == 6


def test_a_column_every_row_shares_is_weighed_with_every_rows_draft_in_it():
    """Eight rows, each one draft at survival 0.5, and a column that costs about half a
    one-row forward: one row's draft alone would not pay for widening all eight (8.5 tokens
    in 2.5 ms against 8 in 1.7), the column's eight together do (12 in 2.5). The drafts inside
    a width are verified for nothing, so the choice is the width."""
    sched = BatchScheduler(curve(0.1))
    assert sched.keep([1] * 8, [4] * 8, [[0.5]] * 8, [[]] * 8) == [1] * 8
    assert sched.cut == 0
    # a row whose drafts are estimated at zero verifies none, even inside the width
    assert sched.keep([2, 2], [4, 4], [[0.9, 0.9], [0.0, 0.0]], [[], []]) == [2, 0]


def test_the_rounds_drafter_call_counts_in_its_cost():
    """A round pays its drafter call whatever it verifies, so the dearer that call, the more a
    wider verify is worth: at a verify cost where no draft pays alone, a 10 ms drafter call
    makes two columns pay."""
    conf = [[0.95, 0.9], [0.3, 0.2, 0.1, 0.1]]
    assert BatchScheduler(DEAR).keep([2, 4], [4, 4], conf, [[], []]) == [0, 0]
    dear_draft = Calibration({}, DEAR.verify_ms, draft_ms=10.0)
    assert BatchScheduler(dear_draft).keep([2, 4], [4, 4], conf, [[], []]) == [2, 2]


def test_a_batch_wider_than_the_curve_reads_the_line_of_its_upper_half():
    """Past the widest measured width a batch's verify cost is extrapolated. The last two
    points alone may differ by a kernel's tile boundary (here a 1 ms step), which a batch of
    eight would read eight times over; the line through the curve's upper half does not."""
    cal = Calibration({}, {128: [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 2.6]})
    assert cal.batch_verify_cost(1, 8) == pytest.approx(2.6e-3)  # measured
    slope = (2.6 - 1.3) / 4  # from width 4 to width 8
    assert cal.batch_verify_cost(2, 8) == pytest.approx((2.6 + 8 * slope) / 1000)


def test_rows_of_a_scheduled_batch_draft_their_drafters_whole_cap(pipes):
    """Under the default cap (auto), the scheduler picks each round's width, so a batched row
    drafts all its proposer can and the scheduler cuts; with the scheduler off, a row drafts
    the pipeline's cap, and a cap given is kept."""
    pipe = scheduled(pipes["dspark"], FLAT)
    assert pipe.max_draft < pipe.proposer.max_draft  # otherwise this shows nothing
    ids = prompts(pipe)[0]

    def cap(**kwargs) -> int:
        return pipe.start_row(ids, max_tokens=4, stop_tokens=set(), **kwargs).row.cap_limit

    assert cap() == cap(max_draft="auto") == pipe.proposer.max_draft
    assert cap(max_draft=2) == 2
    pipe.schedule_batches = False
    assert cap() == pipe.max_draft


def test_without_confidence_the_rows_running_acceptance_decides():
    """No confidence: each row's running acceptance gives its survivals. A row whose first
    draft keeps failing is cut where a row that keeps every draft is not."""
    good, bad = [], []
    for _ in range(20):
        learn_acceptance(good, 4, 4)
        learn_acceptance(bad, 4, 0)
    assert bad[1:] == [0.7] * 3  # positions a round never reached keep the prior
    none = [None, None]
    assert BatchScheduler(curve(0.1)).keep([2, 4], [4, 4], none, [good, good]) == [2, 4]
    assert BatchScheduler(curve(0.1)).keep([2, 4], [4, 4], none, [good, bad]) == [2, 2]
    assert BatchScheduler(curve(0.1)).keep([4, 4], [4, 4], none, [bad, bad]) == [0, 0]
    assert survival([0.5, 2.0, -1.0]) == [0.5, 0.5, 0.0]  # clamped, non-increasing


def test_a_lookup_copy_stays_whole_and_its_width_is_free():
    """A copy past its row's cap (lookup_assist.py) is the copy's own choice: kept whole, and
    the other rows verify every draft that fits inside the width it sets."""
    sched = BatchScheduler(curve(0.1))
    conf = [None, [0.6, 0.5, 0.5, 0.5]]
    assert sched.keep([12, 4], [4, 4], conf, [[], []]) == [12, 4]
    # one drafting row is weighed too (a batch of one in the server), against both rows' cost
    assert sched.keep([0, 4], [4, 4], conf, [[], []]) == [0, 1]
    assert sched.keep([0, 0], [4, 4], conf, [[], []]) == [0, 0]  # nothing drafted: no round
    assert sched.rounds == 2
    # under a given cap a copy may be no wider than it: still whole, and still free
    low = [[0.1] * 4, conf[1]]  # as a draft, the first row would be cut on these
    assert sched.keep([4, 4], [4, 4], low, [[], []], copied=[True, False]) == [4, 4]
    # as drafts, the batch verifies one column: the first row's first rides in it, its
    # other three are cut
    assert sched.keep([4, 4], [4, 4], low, [[], []]) == [1, 1]


def test_a_cut_proposal_keeps_its_q_rows_confidences_and_host_ids():
    probs = mx.ones((4, 8)) / 8
    p = Proposal(mx.array([5, 6, 7, 8], dtype=mx.uint32), 4, probs, mx.array([0.9] * 4))
    two = p.first(2)
    assert two.k == 2 and two.tokens.tolist() == [5, 6]
    assert two.probs.shape == (2, 8) and two.confidence.shape == (2,)
    assert p.first(4) is p and p.first(0).k == 0
    copy = Proposal.from_list([1, 2, 3]).first(1)
    assert copy.host == [1] and copy.tokens.tolist() == [1]


def test_sampled_rows_sharing_a_seed_are_scheduled_on_running_acceptance():
    """Two sampled rows with one seed draw their drafts from the same keys: neither row's
    confidences (which read its drafts) may steer the other's cut."""
    rows = [
        SimpleNamespace(sampling=s)
        for s in (
            SamplingParams(0.8, seed=1),
            SamplingParams(0.8, seed=1),
            SamplingParams(),
            SamplingParams(0.8, seed=2),
            SamplingParams(0.8),
            SamplingParams(0.8),
        )
    ]
    assert _own_keys(rows) == [False, False, True, True, True, True]


def test_metrics_count_the_drafts_cut():
    metrics = Metrics()
    metrics.drafts_cut(3)
    metrics.drafts_cut(0)
    assert "outrider_batch_drafts_cut_total 3" in metrics.render({})


# -- the loop: greedy rows equal their single-request output --------------------------------------


@pytest.mark.parametrize("mode", ["dspark", "dflash", "lookup"])
def test_greedy_rows_match_each_row_alone_with_the_scheduler(pipes, mode):
    """dspark: survivals from the confidence head; dflash, lookup: from running acceptance."""
    pipe = scheduled(pipes[mode], CHEAP)
    rows = prompts(pipe)
    kwargs = dict(max_tokens=24, stop_tokens=set())
    batch = pipe.generate_batch(rows, **kwargs)
    singles = [pipe.generate(ids, **kwargs) for ids in rows]
    assert [r.tokens for r in batch] == [r.tokens for r in singles]
    sched = pipe.scheduler
    assert sched is not None and sched.rounds > 0 and 0 < sched.cut
    if mode != "lookup":  # lookup rarely has two rows drafting at once here
        assert sched.cut < sched.proposed  # some drafts were verified too


def test_no_calibration_or_switched_off_means_no_scheduler(pipes):
    pipe = scheduled(pipes["dspark"], None)
    assert pipe.batch_scheduler() is None and pipe.make_batch().scheduler is None
    pipe = scheduled(pipes["dspark"], FLAT)
    assert pipe.make_batch().scheduler is pipe.batch_scheduler() is not None
    pipe.schedule_batches = False
    assert pipe.make_batch().scheduler is None


def test_a_cut_round_teaches_the_cap_policy_acceptance_only(pipes):
    """A row whose drafts the scheduler cut ran at a width its AutoCap did not choose: the
    policy learns acceptance from it, never the round's cost at the cut width."""
    pipe = scheduled(pipes["dflash"], curve(0.1))
    batch = Batch(pipe.target, pipe.batch_scheduler())
    starts = [pipe.start_row(ids, max_tokens=12, stop_tokens=set()) for ids in prompts(pipe)[:2]]
    for start in starts:
        start.row.policy = AutoCap(pipe.proposer.max_draft)
        batch.join(start.row, start.cache)
    steps = verify_round(pipe.target, batch.rows, batch.cache, scheduler=batch.scheduler)
    assert all(s.cut > 0 and s.drafted for s in steps)  # cut, not to nothing
    for start, step in zip(starts, steps):
        policy = start.row.policy
        assert policy.rounds == {} and policy.costs == {}  # no round, no cost at the cut width
        assert policy.accept[0] < 0.7 or step.accepted  # acceptance learnt (a miss at draft 1)


# -- sampled rows keep the target's distribution ----------------------------------------------


@pytest.mark.slow  # 500 batched generations: about 35 s on a 2-core CPU
def test_sampled_rows_follow_the_target_distribution_with_the_scheduler(pipes):
    """Row 0 samples next to a row with another seed; the scheduler (confidence survivals, a
    verify cost that cuts row 0's drafts in some rounds and not in others, depending on the
    drafts so far) decides how many of them are verified. Chi-square of row 0's first three
    tokens against the target's own joint distribution."""
    pipe = scheduled(pipes["dspark"], curve(0.1))
    rows = prompts(pipe)
    prompt, depth, n = rows[1], 3, 500
    expected = exact_joint(pipe.target, prompt, PARAMS, depth)
    sample = dict(temperature=PARAMS.temperature, top_p=PARAMS.top_p, top_k=PARAMS.top_k)
    counts, cuts, accepted = Counter(), Counter(), 0
    for seed in range(n):
        batch = pipe.make_batch()
        first = pipe.start_row(prompt, max_tokens=depth + 2, stop_tokens=set(), seed=seed, **sample)
        other = pipe.start_row(rows[0], max_tokens=8, stop_tokens=set(), seed=n + seed, **sample)
        for start in (first, other):
            batch.join(start.row, start.cache)
        tokens = list(first.first.tokens)
        while len(tokens) < depth:
            for row, step in batch.round():
                if row is first.row:
                    tokens += step.committed
                    cuts[step.cut] += 1
                    accepted += step.accepted
        counts[tuple(tokens[:depth])] += 1
    assert cuts[0] and sum(cuts.values()) > cuts[0]  # rounds cut and rounds not cut
    assert accepted > 0  # rejection sampling accepted drafts, not only plain steps
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


# -- the server: on by default where a calibration exists, counted in /metrics ----------------


def test_served_batches_are_scheduled_and_each_answer_equals_plain_greedy(qwen3_target, drafters):
    """Concurrent requests share rounds whose drafts the scheduler cuts; every answer is plain
    greedy decoding's, and /metrics counts the cut drafts (none once the engine turns the
    scheduler off)."""
    import asyncio

    import openai
    from conftest import plain_greedy
    from live_server import detok, live_server
    from test_server_batching import metric

    from outrider.prompts import encode_messages
    from outrider.server.engine import LoadSpec, default_loader
    from outrider.server.generation import Limits

    def loader(spec: LoadSpec):
        pipe = default_loader(spec)
        pipe.calibration = CHEAP
        return pipe

    spec = LoadSpec(str(qwen3_target), str(drafters["dspark"]), "dspark")
    limits = Limits(default_max_tokens=16, max_tokens_cap=4096, keepalive_s=0.25)
    asks = [(f"Count to {i}, then stop.", 10 + 2 * i) for i in range(4)]
    with live_server(spec, limits, loader=loader, max_batch=4) as (url, engine):
        tok = engine.pipeline.tokenizer
        msgs = {t: [{"role": "user", "content": t}] for t, _ in asks}
        want = [detok(tok, plain_greedy(qwen3_target, encode_messages(tok, msgs[t]), n))
                for t, n in asks]  # fmt: skip

        async def one(client, text: str, n: int) -> str:
            out = await client.chat.completions.create(
                model="qwen3", messages=msgs[text], max_tokens=n, extra_body={"ignore_eos": True}
            )
            return out.choices[0].message.content

        async def all_of_them() -> list[str]:  # a client per event loop
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            return await asyncio.gather(*(one(client, t, n) for t, n in asks))

        assert asyncio.run(all_of_them()) == want
        cut = metric(url, "outrider_batch_drafts_cut_total")
        assert cut > 0 and metric(url, "outrider_batch_rows_max") > 1
        engine.batch_scheduler = False
        rounds = metric(url, "outrider_batch_rounds_total")
        assert asyncio.run(all_of_them()) == want
        assert metric(url, "outrider_batch_rounds_total") > rounds
        assert metric(url, "outrider_batch_drafts_cut_total") == cut


# -- the batch's prefix scheduler (DSpark paper, Algorithm 1) ----------------------------------


def test_admit_stops_at_the_first_candidate_that_does_not_pay():
    """The paper's Appendix A case: one row, a_1 = 0.8, step rates 1.0, 0.5, 0.45 at widths 1-3.
    Verifying draft 1 lowers throughput (1.8 x 0.5 < 1.0), so nothing is admitted, whatever
    the second confidence (which depends on draft 1) says: with c_2 = 0.9 a full search would
    admit both (2.52 x 0.45 > 1.0) and bias sampled output."""
    rates = {1: 1.0, 2: 0.5, 3: 0.45}
    cost = lambda rows, width: 1.0 / rates[width]  # noqa: E731
    for c2 in (0.0, 0.5, 0.9, 1.0):
        assert admit([[0.8, 0.8 * c2]], cost) == [0]


def test_admit_takes_every_draft_when_verify_width_is_free():
    assert admit([[0.9, 0.8, 0.7], [0.5, 0.2, 0.1]], lambda rows, width: 1.0) == [3, 3]


def test_admit_widens_for_the_confident_row_and_fills_the_width_for_free():
    """Each token a forward processes costs 10% of a one-row step, and rows pad to the widest:
    the confident row's drafts widen the forward; the other row's drafts then cost nothing
    and are verified too, but never one whose survival is zero."""
    cost = lambda rows, width: 1.0 + 0.1 * (rows * width - 1)  # noqa: E731
    assert admit([[0.95, 0.9, 0.85, 0.8], [0.3, 0.05, 0.01, 0.0]], cost) == [4, 3]
    # when no row is confident enough to widen the forward, nobody drafts
    assert admit([[0.1, 0.01], [0.05]], cost) == [0, 0]


def test_admit_with_no_confidence_verifies_anchors_only():
    assert admit([[0.0, 0.0], [0.0]], lambda rows, width: 1.0) == [0, 0]
    assert admit([], lambda rows, width: 1.0) == []
