"""Acceptance of a drafted block against the target's logits.

Either way a round costs one host-device sync. Committed tokens are the accepted drafts followed
by one token of the target's own (the correction at the first rejection, or the bonus after full
acceptance).
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import SamplingParams, probabilities, sample


def accept_greedy(target: list[int], drafts: list[int]) -> int:
    """Accepted drafts: the longest prefix of `drafts` equal to the target's greedy tokens.

    Runs on the host over the k+1 greedy tokens the round's one sync brought back (cheaper than
    three more device kernels for a comparison of at most a few dozen ids). Where a draft
    matches, the two tokens are equal, so the committed tokens are target[:a+1].
    """
    a = 0
    for d, t in zip(drafts, target):
        if d != t:
            break
        a += 1
    return a


def accept_sampled(
    logits: mx.array,
    drafts: mx.array,
    draft_probs: mx.array | None,
    params: SamplingParams,
    key: mx.array,
) -> tuple[mx.array, mx.array]:
    """Speculative rejection sampling (Leviathan et al.; Chen et al.).

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    replacement is drawn from norm(max(0, p_i - q_i)); after full acceptance a bonus token is
    drawn from p_k. draft_probs=None means the drafts were proposed deterministically (one-hot q),
    as for lookup and greedy-drafted blocks. The committed tokens then follow the target's
    distribution exactly.
    """
    p = probabilities(logits, params)  # [k+1, V]
    k = drafts.shape[0]
    k_accept, k_resid = mx.random.split(key)
    if k == 0:
        return mx.array(0), sample(p, k_resid)
    rows = mx.arange(k)
    p_d = p[rows, drafts]
    if draft_probs is None:
        q = mx.zeros((k, p.shape[-1]), dtype=p.dtype)
        q = mx.put_along_axis(q, drafts[:, None], mx.ones((k, 1), dtype=p.dtype), axis=-1)
    else:
        q = draft_probs.astype(p.dtype)
    q_d = q[rows, drafts]
    u = mx.random.uniform(shape=(k,), key=k_accept)
    ok = (u * q_d < p_d).astype(mx.int32)
    accepted = mx.cumprod(ok).sum()
    residual = mx.maximum(p[:k] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # A zero residual only happens where p == q, where rejection has probability zero.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    fix_dist = mx.concatenate([residual, p[k:]], axis=0)  # row k is the bonus distribution
    fixes = sample(fix_dist, k_resid)  # [k+1]
    positions = mx.arange(k + 1)
    padded = mx.concatenate([drafts, mx.zeros((1,), dtype=drafts.dtype)])
    tokens = mx.where(positions < accepted, padded, fixes.astype(drafts.dtype))
    return accepted, tokens
