"""Sampled output follows the target's distribution: chi-square over many seeds."""

from __future__ import annotations

import itertools
from collections import Counter

import mlx.core as mx
import pytest
from sampling_check import PARAMS, chi2_critical, chi_square, exact_joint

import outrider
from outrider.core.acceptance import accept_sampled
from outrider.core.sampling import SamplingParams, probabilities
from outrider.testing import make_tiny_drafter, make_tiny_target

N = 600


@pytest.fixture(scope="module")
def shallow_target(tmp_path_factory):
    """A 2-layer qwen3 (its drafters one layer): the chi-square needs hundreds of short runs,
    not depth; each costs ~60% of a run on the 4-layer session pair, over the same sampling
    and acceptance code."""
    root = tmp_path_factory.mktemp("sampled")
    return make_tiny_target(root / "qwen3-2-layers", family="qwen3", num_hidden_layers=2)


# dspark in the quick tier; the other two modes share its acceptance code and run in the full suite
@pytest.mark.parametrize(
    "mode",
    [
        "dspark",
        pytest.param("lookup", marks=pytest.mark.slow),
        pytest.param("dflash", marks=pytest.mark.slow),
    ],
)
def test_speculative_sampling_matches_target_distribution(shallow_target, tmp_path, mode):
    target, drafter = shallow_target, None
    packaging = {"dspark": ("deepspec", 8), "dflash": ("zlab", 9)}.get(mode)
    if packaging is not None:  # a one-layer drafter, its block wide enough for the cap of 4
        drafter = make_tiny_drafter(
            tmp_path / "d", target, mode, packaging[0], block_size=packaging[1], num_layers=1
        )
    pipe = outrider.load(str(target), None if drafter is None else str(drafter), mode=mode)
    depth = 3
    # Drafter modes: one round of depth - 1 drafts after the prefill's token decides the
    # tokens counted, so generation stops there.
    prompt, n, max_tokens = [30 + 7 * i % 200 for i in range(12)], N, depth + 1
    if mode == "lookup":
        # Every id occurs once in the prompt, so lookup always has a continuation to draft;
        # its drafts are rarely what the target samples, so it gets more rounds to accept in.
        # The long prompt repeats every run: the prefix cache supplies it (its sampled output
        # must follow the target's distribution too).
        prompt, n, max_tokens = list(range(256)) + [40, 41, 42], N, 5
        pipe.enable_prefix_cache(gb=0.5)
    expected = exact_joint(pipe.target, prompt, PARAMS, depth)
    counts = Counter()
    drafted = accepted = reused = 0
    for seed in range(n):
        res = pipe.generate(
            prompt,
            max_tokens=max_tokens,
            max_draft=4,
            temperature=PARAMS.temperature,
            top_p=PARAMS.top_p,
            top_k=PARAMS.top_k,
            seed=seed,
            stop_tokens=set(),
        )
        counts[tuple(res.tokens[:depth])] += 1
        reused += res.cached_tokens
        drafted += sum(len(r.drafted) for r in res.rounds)
        accepted += sum(r.accepted for r in res.rounds)
    assert drafted > 0  # the speculative path really ran
    if mode == "lookup":
        assert 0 < accepted < drafted  # both acceptance and rejection were exercised
        assert reused >= (n - 1) * (len(prompt) - 1)  # every run after the first was a hit
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


def test_rejection_sampling_with_mismatched_draft_distribution():
    """Unit check of the acceptor: p and q disagree strongly; the output follows p."""
    vocab = 4
    p_logits = mx.log(mx.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    q = mx.array([[0.7, 0.1, 0.1, 0.1]])
    params = SamplingParams(temperature=1.0)
    counts = Counter()
    n = 6000
    # every draft drawn from q up front and a key for each acceptance: the acceptor alone runs
    # per sample
    draft_key, accept_key = mx.random.split(mx.random.key(0))
    drafts = mx.random.categorical(mx.log(q), shape=(n, 1), key=draft_key).astype(mx.uint32)
    keys = mx.random.split(accept_key, n)
    for i in range(n):
        a, toks = accept_sampled(p_logits, drafts[i], q, params, keys[i])
        counts[int(toks[0].item())] += 1
    expected = {(t,): p for t, p in enumerate([0.1, 0.2, 0.3, 0.4])}
    stat, dof = chi_square(Counter({(k,): v for k, v in counts.items()}), expected, n)
    assert stat < chi2_critical(dof)
    assert set(counts) <= set(range(vocab))


def test_probabilities_respect_top_k_and_top_p():
    logits = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3)).tolist()[0]
    assert p[3] == 0 and p[4] == 0 and abs(sum(p) - 1) < 1e-6
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist()[0]
    assert p[0] == pytest.approx(1.0)  # the first token alone holds > 0.5 of the mass
    for combo in itertools.product([0.5, 1.0, 2.0], [0, 2], [0.3, 1.0]):
        t, k, top_p = combo
        p = probabilities(logits, SamplingParams(temperature=t, top_k=k, top_p=top_p)).tolist()[0]
        assert abs(sum(p) - 1) < 1e-5


class TargetLikeProposer:
    """Drafts by sampling the target itself at another temperature: q overlaps p heavily but
    differs, so acceptance ratios p/q are neither 0 nor 1 and every branch of rejection sampling
    (accept, reject + residual, bonus) carries real probability mass."""

    name = "target-like"
    tap_layer_ids = ()
    max_draft = 3

    def __init__(self, target, params: SamplingParams) -> None:
        self.target, self.params = target, params
        self._q: dict[tuple[int, ...], mx.array] = {}  # history -> q (a fresh forward's)

    def draft_distribution(self, history: list[int]) -> mx.array:
        """q after `history`: the target's own fresh forward at the draft parameters. It is a
        function of the history alone, so each history is forwarded once (many seeds share
        the few histories a short sampled run reaches)."""
        key = tuple(history)
        if key not in self._q:
            logits, _ = self.target.forward(mx.array(history), self.target.make_cache())
            self._q[key] = probabilities(logits[-1], self.params)
            mx.eval(self._q[key])
        return self._q[key]

    def start(self, prompt, taps):
        pass

    def observe(self, accepted, taps):
        pass

    def propose(self, ctx):
        from outrider.core.proposer import Proposal

        history, tokens, probs = list(ctx.tokens), [], []
        keys = mx.random.split(ctx.key, ctx.cap)
        for i in range(ctx.cap):
            q = self.draft_distribution(history)
            tok = int(mx.random.categorical(mx.log(q), key=keys[i]).item())
            tokens.append(tok)
            probs.append(q)
            history.append(tok)
        return Proposal(mx.array(tokens, dtype=mx.uint32), len(tokens), probs=mx.stack(probs))


@pytest.mark.slow  # ~13 s; the mismatched-distribution test covers rejection in the quick tier
def test_sampling_with_overlapping_draft_distribution(qwen3_target):
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    draft_params = SamplingParams(temperature=1.6, top_k=5)
    proposer = TargetLikeProposer(pipe.target, draft_params)
    spec = outrider.pipeline_from_parts(pipe.target, proposer, "target-like", max_draft=3)
    prompt = [30 + 7 * i % 200 for i in range(12)]
    expected = exact_joint(pipe.target, prompt, PARAMS, 3)
    counts, n = Counter(), N
    accepted = drafted = 0
    for seed in range(n):
        res = spec.generate(
            prompt,
            max_tokens=4,
            temperature=PARAMS.temperature,
            top_p=PARAMS.top_p,
            top_k=PARAMS.top_k,
            seed=seed,
            stop_tokens=set(),
        )
        counts[tuple(res.tokens[:3])] += 1
        accepted += sum(r.accepted for r in res.rounds)
        drafted += sum(len(r.drafted) for r in res.rounds)
    assert 0.2 * drafted < accepted < 0.95 * drafted  # acceptance is partial and substantial
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"
