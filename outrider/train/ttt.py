"""EAGLE-3's training-time test (TTT) objective, batched over sampled rows.

DeepSpec (`deepspec/modeling/eagle3/loss.py`, after SpecForge) trains the one-layer drafter on
`ttt_length` chained steps. Step 0 reads, at row t, the target's taps at t with token t+1 at RoPE
position t and predicts token t+2; step j feeds row t the drafter's own output of step j-1 with
token t+j+1 at position t+j. A query of step j sees the step-0 keys of rows <= t and row t's own
keys of steps 1..j: exactly what the inference chain (`Eagle3Proposer`) sees when it drafts j
tokens after committed row t. Each step's loss is the soft cross-entropy against the target's
distribution of the token it predicts, weighted by `step_loss_decay` ** j (0.8).

DeepSpec runs every row of a window through every step. Here the step-0 keys are computed for
every row (one cheap pass), but the chain runs only from sampled rows ("anchors", as the block
drafters' objective samples them): a row's chain depends on no other row's chain, so this is
the same loss on a random subset of rows, and the 49k-word output head runs on N rows a step
instead of T.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..plugins.strategies.eagle3_drafter import Eagle3Drafter, Eagle3Layer
from .objectives import Batch, gather_rows, sample_anchors

STEP_LOSS_DECAY = 0.8  # DeepSpec's step_loss_decay


def chain_anchors(
    mask: np.ndarray, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Up to `n` rows per window whose first two predictions (tokens t+1, t+2) are supervised:
    row t's step 0 predicts token t+2, and the row pairs its taps with token t+1."""
    return sample_anchors(mask[:, 1:], n, rng)


def target_positions(anchors: mx.array, depth: int) -> mx.array:
    """[b, N, depth]: where the target's logits predict what step j predicts (token a+j+2)."""
    return anchors[..., None] + 1 + mx.arange(depth)


def _heads(x: mx.array, count: int) -> mx.array:
    """[b, S, count·hd] -> [b, count, S, hd]."""
    b, s, _ = x.shape
    return x.reshape(b, s, count, -1).transpose(0, 2, 1, 3)


def _normed(layer: Eagle3Layer, which: str, x: mx.array) -> mx.array:
    """Qwen3 layers norm q and k per head (`q_norm`, `k_norm`); Llama layers do not."""
    norm = f"{which}_norm"
    return layer.self_attn[norm](x) if norm in layer.self_attn else x


def _rope_rows(layer: Eagle3Layer, x: mx.array, offsets: mx.array) -> mx.array:
    """RoPE each row of x [b, heads, N, hd] at its own position offsets [b, N]."""
    b, h, n, d = x.shape
    rows = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)
    rows = layer.self_attn.rope(rows, offset=offsets.reshape(-1))
    return rows.reshape(b, n, h, d).transpose(0, 2, 1, 3)


def _layer_input(layer: Eagle3Layer, embeds: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
    """(x = [input_layernorm(E) ; hidden_norm(g)], the residual), as `Eagle3Layer` builds them."""
    normed = layer.hidden_norm(g)
    residual = normed if layer.norm_before_residual else g
    return mx.concatenate([layer.input_layernorm(embeds), normed], axis=-1), residual


def chain_forward(
    drafter: Eagle3Drafter, ids: mx.array, taps: mx.array, anchors: mx.array, depth: int
) -> list[mx.array]:
    """ids [b, T], taps [b, T, n·H], anchors [b, N] -> per step j < depth the output [b, N, H]
    that the chain feeds back (and `head_input` reads) after drafting j tokens from row a."""
    b, t = ids.shape
    layer, attn = drafter.layers[0], drafter.layers[0].self_attn
    n_heads, n_kv = attn.n_heads, attn.n_kv
    dtype = drafter.norm.weight.dtype
    n_anchors = anchors.shape[1]

    # step 0 over every row: taps at t with token t+1 (the last row's token is never read)
    nxt = mx.concatenate([ids[:, 1:], ids[:, :1]], axis=1).astype(mx.uint32)
    g0 = drafter.project(taps.reshape(b * t, -1)).reshape(b, t, -1).astype(dtype)
    x0, residual0 = _layer_input(layer, drafter.embed_tokens(nxt), g0)
    keys = [attn.rope(_normed(layer, "k", _heads(attn.k_proj(x0), n_kv)))]
    values = [_heads(attn.v_proj(x0), n_kv)]
    context = mx.arange(t)[None, None, :] <= anchors[:, :, None]  # [b, N, T]
    own = mx.broadcast_to(mx.eye(n_anchors, dtype=mx.bool_)[None], (b, n_anchors, n_anchors))

    x = gather_rows(x0, anchors[..., None])[:, :, 0]
    residual = gather_rows(residual0, anchors[..., None])[:, :, 0]
    outputs = []
    for j in range(depth):
        if j > 0:  # row a's chain: its own last output with token a+j+1, at position a+j
            token = gather_rows(ids, anchors[..., None] + j + 1)[:, :, 0].astype(mx.uint32)
            x, residual = _layer_input(layer, drafter.embed_tokens(token), outputs[-1])
            k = _normed(layer, "k", _heads(attn.k_proj(x), n_kv))
            keys.append(_rope_rows(layer, k, anchors + j))
            values.append(_heads(attn.v_proj(x), n_kv))
        q = _normed(layer, "q", _heads(attn.q_proj(x), n_heads))
        q = _rope_rows(layer, q, anchors + j)
        mask = mx.concatenate([context] + [own] * j, axis=-1)[:, None]
        out = mx.fast.scaled_dot_product_attention(
            q,
            mx.concatenate(keys, axis=2),
            mx.concatenate(values, axis=2),
            scale=attn.scale,
            mask=mask,
        )
        h = residual + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n_anchors, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(drafter.norm(h) if drafter.norm_feedback else h)
    return outputs


def losses(
    drafter: Eagle3Drafter, batch: Batch, depth: int, decay: float = STEP_LOSS_DECAY
) -> tuple[mx.array, dict[str, mx.array]]:
    """Σ_j decay^j · soft-CE(target, step j) over the sampled rows, each step divided by the
    kept rows (DeepSpec's "local_mean": unsupervised rows add 0, the divisor counts them all);
    and `tau`, the teacher-forced greedy chain length against the window's own tokens (DeepSpec
    logs it against the target's argmax; self-distilled windows hold exactly those)."""
    t = batch.ids.shape[1]
    outputs = chain_forward(drafter, batch.ids, batch.taps, batch.anchors, depth)
    kept = batch.keep.astype(mx.float32)
    rows = mx.maximum(kept.sum(), 1.0)
    loss = mx.array(0.0)
    hits, firsts, supervised_rows = [], None, None
    for j, h in enumerate(outputs):
        z = drafter.lm_head(drafter.head_input(h)).astype(mx.float32)
        logq = z - mx.logsumexp(z, axis=-1, keepdims=True)
        ce = -(batch.target_probs[:, :, j] * logq).sum(axis=-1)
        where = batch.anchors + j + 2  # the token step j predicts
        label = gather_rows(batch.ids, where[..., None])[:, :, 0]
        supervised = gather_rows(batch.mask, where[..., None])[:, :, 0] > 0
        valid = ((where < t) & supervised).astype(mx.float32) * kept
        step = (valid * ce).sum() / rows
        if firsts is None:
            # (kept.sum() itself as an aux output, the node the loss divides by, breaks
            # mx.compile of value_and_grad in mlx 0.32.4: "_Map_base::at"; this one does not)
            firsts, supervised_rows = step, valid.sum()
        loss = loss + decay**j * step
        hits.append((mx.argmax(z, axis=-1) == label).astype(mx.float32) * valid)
    hit = mx.stack(hits, axis=-1)  # [b, N, depth]
    tau = 1 + mx.cumprod(hit, axis=-1).sum() / rows
    return loss, {"ce": firsts, "tau": tau, "supervised": supervised_rows}


def check_chain_forward(drafter: Eagle3Drafter, depth: int = 3, seq_len: int = 12) -> float:
    """Max |difference| between the batched TTT forward and the cached inference chain (taps and
    tokens through `Eagle3Drafter.step`, as the proposer runs it) on a small random input,
    relative to the largest |value|. Run once per training run on the device that trains."""
    spec = drafter.spec
    dtype = drafter.norm.weight.dtype
    key = mx.random.key(0)
    taps = mx.random.normal((1, seq_len, len(spec.target_layer_ids) * spec.hidden_size), key=key)
    taps = taps.astype(dtype)
    ids = mx.random.randint(0, spec.vocab_size, (1, seq_len), key=key).astype(mx.uint32)
    anchors = mx.array([[2, seq_len - depth - 2]])
    outputs = chain_forward(drafter, ids, taps, anchors, depth)
    worst = 0.0
    for i in range(anchors.shape[1]):
        a = anchors[0, i].item()
        cache = drafter.make_cache()
        h = drafter.step(
            drafter.embed_tokens(ids[0, 1 : a + 2])[None], drafter.project(taps[0, : a + 1]), cache
        )[:, -1:]
        for j in range(depth):
            if j > 0:
                h = drafter.step(
                    drafter.embed_tokens(ids[0, a + j + 1 : a + j + 2])[None], h, cache
                )
            ref = h[0, 0].astype(mx.float32)
            got = outputs[j][0, i].astype(mx.float32)
            worst = max(worst, (mx.abs(ref - got).max() / mx.abs(ref).max()).item())
    return worst
