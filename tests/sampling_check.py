"""Checking that sampled output follows the target's own distribution: the exact joint
distribution of the next few tokens, Pearson's chi-square against it, and the sampling loop the
lossless tests of every mode and packaging share."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx

from outrider.core.sampling import SamplingParams, probabilities

# chi-square critical values at p = 0.001 (dof -> value), enough for the cell counts used here
CHI2_999 = {
    d: v for d, v in [(3, 16.27), (7, 24.32), (15, 37.70), (31, 61.10), (63, 103.4), (124, 174.6)]
}


def chi2_critical(dof: int) -> float:
    # Wilson-Hilferty approximation at p = 0.001 (z = 3.09) for dof not tabulated
    if dof in CHI2_999:
        return CHI2_999[dof]
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson statistic, pooling cells with expected count < 5 into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for outcome, p in expected.items():
        e = p * n
        o = counts.get(outcome, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    outside = n - sum(counts.get(k, 0) for k in expected)  # outcomes the target forbids
    assert outside == 0, f"{outside} samples fell outside the target's support"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    return stat, cells - 1


def exact_joint(target, prompt: list[int], params: SamplingParams, depth: int) -> dict:
    """The target's own distribution over the next `depth` tokens (fresh forwards)."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in out.items():
            logits, _ = target.forward(mx.array(prompt + list(prefix)), target.make_cache())
            probs = probabilities(logits[-1], params).tolist()
            for tok, q in enumerate(probs):
                if q > 0:
                    nxt[prefix + (tok,)] = p * q
        out = nxt
    return out


PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=5)


def sampled_runs(
    pipe, prompt: list[int], depth: int, n: int, params: SamplingParams = PARAMS, max_draft: int = 4
) -> tuple[Counter, int, int]:
    """(counts of the first `depth` tokens, drafts proposed, drafts accepted) over seeds 0..n-1."""
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(n):
        res = pipe.generate(
            prompt,
            max_tokens=depth + 1,
            max_draft=max_draft,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=seed,
            stop_tokens=set(),
        )
        counts[tuple(res.tokens[:depth])] += 1
        drafted += sum(len(r.drafted) for r in res.rounds)
        accepted += sum(r.accepted for r in res.rounds)
    return counts, drafted, accepted


def assert_follows_target(
    pipe, prompt: list[int], depth: int, n: int, params: SamplingParams = PARAMS
) -> tuple[int, int]:
    """Sample n times and check the chi-square statistic; returns (drafted, accepted)."""
    expected = exact_joint(pipe.target, prompt, params, depth)
    counts, drafted, accepted = sampled_runs(pipe, prompt, depth, n, params)
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"
    return drafted, accepted
