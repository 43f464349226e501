"""The block drafter shared by DSpark and DFlash: a small Qwen3-style stack that attends, from a
block [anchor, mask, ...], to the target's tapped hidden states projected into its own K/V.

Per draft call (deepseek-ai/DeepSpec, `deepspec/modeling/dspark/qwen3/modeling.py`; the DSpark
paper, Eqs. 2-3): context rows C = hidden_norm(fc(taps)) are appended to
each layer's context cache as K/V (roped at their absolute positions; the context skips
input_layernorm); the block attends bidirectionally to every cached context row and to the whole
block; block slot k sits at position anchor + k. Block K/V are never cached.

Heads of the DFlash lineage change what a block query sees (NVIDIA's Nemotron DSpark head):
a causal block (slot k sees slots <= k), a sliding window over positions (a key at most
`window - 1` positions back), and a learned per-head sink logit, a key with no value that
takes its share of the softmax (MLX's `sinks`). The cache of each call says which keys a query
sees (`mask`), so one attention serves every kind of layer.

One call drafts several rows (`ContextBackbone.backbone_rows`, `ContextRows`): every row's
context K/V sit in one left-padded batched cache per layer, each row roped at its own positions
and its padding masked, so each row's hidden states are those it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ...core.device import split_attention
from ...core.draft_vocab import DraftVocab, read_draft_vocab
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ..targets.batched import move_columns, tail_moves
from .drafter_weights import load_strict, quantize


class ContextCache:
    """Append-only K/V of the context rows one draft layer has seen (block K/V never enter)."""

    def __init__(self) -> None:
        self._kv = KVCache()
        self._last: tuple[mx.array | None, mx.array | None] = (None, None)

    @property
    def offset(self) -> int:
        return self._kv.offset

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._last = self._kv.update_and_fetch(keys, values)
        return self._last

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        return self._last

    def mark(self) -> int:
        """Where the context ends now (for `rewind`)."""
        return self._kv.offset

    def rewind(self, mark: int) -> None:
        """Forget the context rows taken in since `mark`: a block drafted ahead took them in
        before its round was read, and the round did not keep them all (dflash2.py)."""
        kv = self._kv
        kv.trim(kv.offset - mark)
        self._last = (None, None)
        if kv.offset:
            self._last = (kv.keys[..., : kv.offset, :], kv.values[..., : kv.offset, :])

    def mask(self, n: int, keys: int, causal: bool, window: int | None) -> mx.array | None:
        """One row, keys in order: its context positions, then the block's."""
        return ordered_mask(self.offset, keys - n, n, causal, window)


def visibility(
    queries: mx.array, keys: mx.array, causal: bool, window: int | None
) -> mx.array | None:
    """Which keys block queries see: positions queries [..., n] and keys [..., K] -> a boolean
    [..., n, K] (None: every key). A window keeps keys fewer than `window` positions back (and,
    in a bidirectional layer, ahead), as transformers' sliding attention does."""
    if not causal and window is None:
        return None
    q, k = queries[..., :, None], keys[..., None, :]
    ok = mx.ones(q.shape[:-1] + k.shape[-1:], dtype=mx.bool_)
    if causal:
        ok = ok & (k <= q)
    if window is not None:
        ok = ok & (q - k < window)
        if not causal:
            ok = ok & (k - q < window)
    return ok


def ordered_mask(
    offset: int, n_ctx: int, n: int, causal: bool, window: int | None
) -> mx.array | None:
    """The mask of one row whose keys are its last `n_ctx` context positions before `offset`,
    in order, then the block's `n` (None when every key is visible)."""
    if not causal and (window is None or n_ctx + n <= window):
        return None  # the window reaches past the first key
    keys = mx.arange(offset - n_ctx, offset + n)
    return visibility(mx.arange(offset, offset + n), keys, causal, window)


@dataclass
class _Call:
    """What one drafter call over `ContextRows` does to them, worked out on the host first.
    Every row takes in its new context; only the drafting rows (`drafting`) run a block."""

    before: mx.array  # [R] each row's context length: its new rows' first position
    block: mx.array  # [D] each drafting row's context length after the call: its block's
    shifts: mx.array | None  # [R, 1] how much each row's padding grows; None: none
    source: mx.array | None  # [R, 1, E, 1] the column each of the last E columns takes
    drop: int  # leading columns no row uses after the call, cut off
    drafting: mx.array | None  # [D] the rows that run a block (None: every row)
    mask: mx.array | None  # [D, 1, 1, keys + block] keys a drafting row sees (None: all)
    ends: list[int]  # each drafting row's context length after the call (on the host)
    positions: mx.array | None = None  # [D, 1, keys, 1] each key column's position
    masks: dict | None = None  # (causal, window) -> that kind of layer's mask, made once


class ContextRows:
    """The context K/V of rows drafted together, for every draft layer: one mlx-lm
    `BatchKVCache` a layer, rows left-padded (every row's last context row in the same column).

    A call appends each row's new context rows, padded to the widest with the padding after the
    row's own rows; a padded row then moves its oldest columns into those trailing slots and its
    left padding grows by as many (the trick `BatchedRows.rollback_rows` plays on the target's
    cache: a row's keys in another order are the same keys to attention, each roped at its own
    position, and the context is never cut back, so the order never matters); leading columns
    that are padding in every row are dropped. Each row's padding is masked, so a row attends to
    exactly the keys it has alone. Rows move in (`add`) and out (`take`, `keep`) between
    calls; lengths and padding are kept on the host, so none of this waits for the device.
    """

    def __init__(self, n_layers: int, positions: bool = False, limit: int | None = None) -> None:
        self.layers = [RowsLayerCache(self) for _ in range(n_layers)]
        # Blocks see at most the last `limit` context rows (the drafter's context window;
        # None: all of them).
        self.limit = limit
        # Sliding-window layers and a limit must know each column's position, and a column's
        # position is not its order (see above): the positions ride along as one more cache,
        # moved, dropped and handed over exactly as the keys are.
        self.positions = RowsLayerCache(self) if positions or limit is not None else None
        self.lengths: list[int] = []  # context rows each row holds
        self.pads: list[int] = []  # each row's left padding
        self.call: _Call | None = None

    @property
    def caches(self) -> list[RowsLayerCache]:
        """Every cache a row has a column in: the layers', then the positions'."""
        return self.layers + ([self.positions] if self.positions is not None else [])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Columns in use: every row's padding plus its context rows."""
        return self.pads[0] + self.lengths[0] if self.lengths else 0

    def begin(self, incoming: list[int], block: int, drafting: list[int]) -> None:
        """Plan a call that adds incoming[i] context rows to row i and runs a block of `block`
        slots for each row of `drafting` (in that order)."""
        widest = max(incoming)
        shifts = [widest - n for n in incoming]
        pads = [p + s for p, s in zip(self.pads, shifts, strict=True)]
        drop = min(pads)
        pads = [p - drop for p in pads]
        width = self.width + widest - drop
        after = [n + m for n, m in zip(self.lengths, incoming)]
        every = drafting == list(range(len(after)))
        mask = None
        seen = [pads[i] for i in drafting]
        if any(seen):
            keys = mx.arange(width + block)[None, :] >= mx.array(seen)[:, None]
            mask = keys[:, None, None, :]
        self.call = _Call(
            mx.array(self.lengths, dtype=mx.int32),
            mx.array([after[i] for i in drafting], dtype=mx.int32),
            mx.array(shifts, dtype=mx.int32)[:, None] if any(shifts) else None,
            tail_moves(self.pads, [min(e, n) for e, n in zip(shifts, after)], self.width + widest),
            drop,
            None if every else mx.array(drafting, dtype=mx.int32),
            mask,
            [after[i] for i in drafting],
        )
        for layer in self.caches:  # context rows go in at `before`; no context: the block
            layer.offset = self.call.before if widest else self.call.block
        self.lengths, self.pads = after, pads
        if self.positions is not None:
            if widest:
                new = self.call.before[:, None] + mx.arange(widest, dtype=mx.int32)
                self.positions.append(*[new[:, None, :, None].astype(mx.float32)] * 2)
            self.call.positions = self.positions.fetch()[0]

    def end(self) -> None:
        self.call = None

    def add(self, row: list[tuple[mx.array, mx.array] | None] | None, length: int) -> None:
        """Append one row: its K/V per cache (`caches`; [1, kv, length, D], None when empty;
        row None: an empty row)."""
        width = max(self.width, length)
        if row is None:
            row = [None] * len(self.caches)
        for layer, kv in zip(self.caches, row, strict=True):
            piece = BatchKVCache([0])
            if kv is not None:
                piece.keys, piece.values = kv
                piece._idx = length
                piece.offset = piece.offset + length
            if layer.kv is None:
                layer.kv = piece
            else:
                layer.kv.extend(piece)
        self.pads = [p + width - self.width for p in self.pads] + [width - length]
        self.lengths = self.lengths + [length]

    def take(self, i: int) -> tuple[list[tuple[mx.array, mx.array] | None], int]:
        """Row i's K/V per cache (compact copies, computed now) and its length; `add` takes
        them."""
        length, pad, width = self.lengths[i], self.pads[i], self.width
        row = []
        for layer in self.caches:
            kv = layer.kv
            if not length or kv.keys is None:
                row.append(None)
                continue
            k = mx.contiguous(kv.keys[i : i + 1, :, pad:width])
            v = mx.contiguous(kv.values[i : i + 1, :, pad:width])
            row.append((k, v))
        if length:
            mx.eval(row)  # copies now: they hold no reference to the old cache
        return row, length

    def trim_last(self, n: int) -> None:
        """Drop the last n context rows of a group of one row: a round drafted ahead took
        them in before its own round was read, and that round did not keep them all
        (`BlockProposer.draft_ahead`). One row has no padding, so its newest rows are its
        last columns."""
        if len(self.lengths) != 1:
            raise ValueError("only a group of one row drops its latest context rows")
        for layer in self.caches:
            if layer.kv is not None:
                layer.kv.trim(n)
        self.lengths = [self.lengths[0] - n]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); columns that become padding in every row go."""
        if not rows:
            for layer in self.caches:
                layer.kv = None
            self.lengths, self.pads = [], []
            return
        pads = [self.pads[i] for i in rows]
        drop = min(pads)
        index = mx.array(rows, dtype=mx.int32)
        for layer in self.caches:
            kv = layer.kv
            if kv.keys is not None:
                kv.keys = kv.keys[index][..., drop:, :]
                kv.values = kv.values[index][..., drop:, :]
                kv._idx -= drop
            kv.offset = kv.offset[index]
            kv.left_padding = kv.left_padding[index] - drop
        self.lengths = [self.lengths[i] for i in rows]
        self.pads = [p - drop for p in pads]


class RowsLayerCache:
    """One draft layer's K/V in `ContextRows`: what `DraftAttention` appends to and reads."""

    def __init__(self, rows: ContextRows) -> None:
        self.rows = rows
        self.kv: BatchKVCache | None = None
        self.offset: mx.array | None = None  # the positions of what comes next, a row

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        call = self.rows.call
        kv = self.kv
        kv.update_and_fetch(keys, values)
        end = kv._idx
        if call.source is not None:  # a padded row's oldest columns into its trailing slots
            move_columns(kv, call.source)
        if call.shifts is not None:
            kv.left_padding = kv.left_padding + call.shifts[:, 0]
            kv.offset = kv.offset - call.shifts[:, 0]
        if call.drop:  # a view: the next write that needs room copies what is left
            kv.keys = kv.keys[..., call.drop :, :]
            kv.values = kv.values[..., call.drop :, :]
            kv._idx = end - call.drop
            kv.left_padding = kv.left_padding - call.drop
        self.offset = call.block
        return self._drafting(*kv.keys_and_values())

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        kv = self.kv
        if kv is None or kv.keys is None or kv._idx == 0:
            return None, None
        return self._drafting(*kv.keys_and_values())

    def _drafting(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The K/V of the rows that run a block this call."""
        rows = self.rows.call.drafting
        if rows is None:
            return keys, values
        return keys[rows], values[rows]

    def mask(self, n: int, keys: int, causal: bool, window: int | None) -> mx.array | None:
        """The keys (`keys` columns, the block's `n` last) each drafting row's block queries
        see: its own columns, not its padding, of those the last `ContextRows.limit` context
        rows, and what the layer's causality and window allow."""
        call, limit = self.rows.call, self.rows.limit
        longest = max(call.ends)
        if (
            not causal
            and (window is None or longest + n <= window)
            and (limit is None or longest <= limit)
        ):
            return call.mask  # the window and the limit reach past every row's first position
        made = call.masks = call.masks or {}
        if (causal, window) not in made:
            block = call.block[:, None] + mx.arange(n, dtype=mx.int32)  # [D, n] positions
            if window is None and (limit is None or longest <= limit):
                seen = visibility(block, block, causal, None)  # [D, n, n]: only the block's
                context = mx.ones((block.shape[0], n, keys - n), dtype=mx.bool_)
                ok = mx.concatenate([context, seen], axis=-1)
            else:
                if call.positions is None:  # no context yet: the block's own keys only
                    context = mx.zeros((block.shape[0], 0), dtype=mx.int32)
                else:
                    context = call.positions[:, 0, :, 0].astype(mx.int32)  # [D, keys - n]
                positions = mx.concatenate([context, block], axis=-1)
                # None only for a bidirectional, windowless layer, here because the limit bites
                ok = visibility(block, positions, causal, window)
                if limit is not None and longest > limit:  # the last `limit` context rows
                    recent = positions >= (call.block - limit)[:, None]  # [D, keys]
                    ok = recent[:, None, :] if ok is None else ok & recent[:, None, :]
                ok = mx.broadcast_to(ok, (block.shape[0], n, keys))
            ok = ok[:, None]  # [D, 1, n, keys]
            made[(causal, window)] = ok if call.mask is None else ok & call.mask
        return made[(causal, window)]


def drafter_rope(spec: DrafterSpec, head_dim: int) -> nn.Module:
    """The drafter's RoPE with the config's theta and scaling, over the full head (or its first
    `rope_dims`, the qwen3_5-native fork's partial rotary): rotate-half (NeoX), or interleaved
    pairs where the packaging says so (LiquidAI's LFM2.5 drafters)."""
    try:
        return initialize_rope(
            spec.rope_dims or head_dim,
            base=spec.rope_theta,
            traditional=spec.rope_traditional,
            scaling_config=spec.rope_scaling,
            max_position_embeddings=spec.max_position_embeddings,
        )
    except KeyError as e:  # a scaling config without a field its kind needs
        scaling = spec.rope_scaling or {}
        kind = scaling.get("type") or scaling.get("rope_type")
        raise CheckpointError(f"the drafter's rope_scaling ({kind}) lacks {e.args[0]!r}") from None


class DraftAttention(nn.Module):
    # Set on the instance when proposing on a CUDA GPU, where MLX's fused attention kernel takes
    # fewer than 4 query rows: the block's rows attend to the same keys with no mask, so they
    # can ride as extra heads of one query row (still grouped per KV head).
    fold_rows = False

    def __init__(self, spec: DrafterSpec, layer_type: str = "full_attention"):
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.n_heads, self.n_kv = spec.num_heads, spec.num_kv_heads
        sliding = layer_type == "sliding_attention"
        self.causal = spec.causal_block or (sliding and spec.causal_sliding)
        self.window = spec.sliding_window if sliding else None
        if spec.attention_sinks:
            self.attention_sink_bias = mx.zeros((self.n_heads,))
        self.scale = hd**-0.5
        self.gated = spec.gated_q
        q_out = self.n_heads * hd * (2 if self.gated else 1)  # [q ‖ gate] per head
        self.q_proj = nn.Linear(h, q_out, bias=spec.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=spec.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
        self.rope = drafter_rope(spec, hd)

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        b, n, _ = x.shape
        if context is not None and context.shape[1] > 0:
            ck, cv = self._kv(context, cache.offset)
            keys, values = cache.append(ck, cv)
        else:
            keys, values = cache.fetch()
        block_offset = cache.offset
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1)
        gate = None
        if self.gated:  # the gate is not normed (mlx-lm's Qwen3NextAttention reads it so too)
            q, gate = mx.split(q, 2, axis=-1)
        q = self.rope(self.q_norm(q).transpose(0, 2, 1, 3), offset=block_offset)
        bk, bv = self._kv(x, block_offset)
        if keys is not None:
            bk = mx.concatenate([keys, bk], axis=2)
            bv = mx.concatenate([values, bv], axis=2)
        mask = cache.mask(n, bk.shape[2], self.causal, self.window)
        sinks = self.get("attention_sink_bias")
        if sinks is not None:  # MLX wants them in the output's type (a checkpoint may differ)
            sinks = sinks.astype(q.dtype)
        if self.fold_rows and mask is None:
            folded = q.reshape(b, self.n_heads * n, 1, -1)
            if sinks is not None:  # folded heads run head by head, each head's slots in turn
                sinks = mx.repeat(sinks, n)
            out = mx.fast.scaled_dot_product_attention(
                folded, bk, bv, scale=self.scale, sinks=sinks
            )
            out = out.reshape(b, self.n_heads, n, -1)
        else:
            out = mx.fast.scaled_dot_product_attention(
                q, bk, bv, scale=self.scale, mask=mask, sinks=sinks
            )
        out = out.transpose(0, 2, 1, 3).reshape(b, n, -1)
        if gate is not None:
            out = out * mx.sigmoid(gate.reshape(b, n, -1))
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_type: str = "full_attention"):
        super().__init__()
        self.self_attn = DraftAttention(spec, layer_type)
        self.mlp = DraftMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def __call__(self, h: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), context, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """DSpark's sequential head: a low-rank bigram bias on each slot's logits.

    `vanilla`: b_k = W2 W1[x_{k-1}], with x_{-1} the anchor; `gated` scales W1[x_{k-1}] by a
    sigmoid gate of [h_k ; W1[x_{k-1}]]; `rnn` carries a rank-r state (deepseek-ai/DeepSpec,
    `deepspec/modeling/dspark/markov_head.py`; the DSpark paper §3.1, Eqs. 5-6).
    """

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        r, h, v = spec.markov_rank, spec.hidden_size, spec.vocab_size
        self.kind = spec.markov_type
        self.rank = r
        self.markov_w1 = nn.Embedding(v, r)
        # W1 is indexed by target ids, W2 writes the head's (possibly reduced) vocabulary
        # (vllm-project/speculators `src/speculators/models/dspark/model_definitions.py`).
        self.markov_w2 = nn.Linear(r, spec.draft_vocab_size or v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r, bias=True)

    def step(
        self, prev: mx.array, hidden: mx.array, state: mx.array | None
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """prev token ids [n], slot hidden [n, H] -> (bias [n, V], W1[prev] [n, r], new state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), e, state
        if self.kind == "gated":
            g = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, e], axis=-1)))
            return self.markov_w2(g * e), e, state
        if state is None:
            state = mx.zeros(e.shape, dtype=e.dtype)
        z = mx.concatenate([state, e, hidden], axis=-1)
        g, c, o = mx.split(self.joint_proj(z), 3, axis=-1)
        g = mx.sigmoid(g)
        new_state = g * state + (1 - g) * mx.tanh(c)
        return self.markov_w2(mx.tanh(o)), e, new_state


class ConfidenceHead(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        extra = spec.markov_rank if spec.confidence_with_markov else 0
        self.proj = nn.Linear(spec.hidden_size + extra, 1, bias=True)


class ContextBackbone:
    """The forward shared by block drafters (DSpark, DFlash, DFlash 2): context rows from the
    tapped hidden states (`fc`, `hidden_norm`), the block through `layers`, then `norm`."""

    forwards = 0  # drafter calls made (tests count them: one a round for a whole batch)

    def backbone(
        self, block: mx.array, taps: mx.array | None, cache: list[ContextCache]
    ) -> mx.array:
        """block embeddings [1, B, H], new context taps [S, n·H] -> final-normed hidden [B, H]."""
        return self.backbone_rows(block, [taps], cache)[0]

    def backbone_rows(self, block: mx.array, taps: list[mx.array | None], cache: list) -> mx.array:
        """Rows together: each row's new context taps [S_i, n·H] (None: none), block
        embeddings [D, B, H] of the rows that draft (`ContextRows` says which) -> their
        final-normed hidden [D, B, H].

        Context rows are made from all rows' taps at once, then padded to the widest, the
        padding after a row's own rows (`ContextRows` rolls it to the front)."""
        self.forwards += 1
        counts = [0 if t is None else t.shape[0] for t in taps]
        context = None
        if max(counts):
            given = [t for t, n in zip(taps, counts) if n]
            flat = given[0] if len(given) == 1 else mx.concatenate(given)
            rows = self.hidden_norm(self.fc(flat.astype(block.dtype)))  # [sum S_i, H]
            widest, parts, at = max(counts), [], 0
            for n in counts:
                part = rows[at : at + n]
                at += n
                if n < widest:
                    pad = mx.zeros((widest - n, rows.shape[-1]), dtype=rows.dtype)
                    part = mx.concatenate([part, pad]) if n else pad
                parts.append(part)
            context = parts[0][None] if len(parts) == 1 else mx.stack(parts)
        h = block
        for layer, c in zip(self.layers, cache):
            h = layer(h, context, c)
        return self.norm(h)


class BlockDrafter(ContextBackbone, nn.Module):
    """DSpark / DFlash drafter network; its parameter names are the canonical tensor names."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        n_taps = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_taps * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        types = spec.layer_types or ("full_attention",) * spec.num_layers
        self.layers = [DraftLayer(spec, t) for t in types]
        self.norm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        if spec.own_embedding:
            self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        if spec.own_lm_head:
            self.lm_head = nn.Linear(h, spec.draft_vocab_size or spec.vocab_size, bias=False)
        if spec.markov_rank > 0:
            self.markov_head = MarkovHead(spec)
        if spec.confidence_head:
            self.confidence_head = ConfidenceHead(spec)

    def make_cache(self) -> list[ContextCache]:
        return [ContextCache() for _ in self.layers]


def load_block_drafter(spec: DrafterSpec, bits: int = 4, group_size: int = 64) -> BlockDrafter:
    """Build the network, check the checkpoint's tensors strictly, load, optionally quantise."""
    if spec.backbone == "gemma4":
        from .gemma4_block_drafter import Gemma4BlockDrafter  # it builds on this module

        if "sliding_attention" in spec.layer_types:
            raise CheckpointError(
                f"this {spec.format} Gemma-4 drafter has sliding-window layers, which the "
                "Gemma-4 block drafter does not run yet"
            )
        model = Gemma4BlockDrafter(spec)
    else:
        if "sliding_attention" in spec.layer_types and not spec.sliding_window:
            raise CheckpointError(f"this {spec.format} drafter has sliding layers but no window")
        model = BlockDrafter(spec)
    got = dict(spec.weights)
    # Vocabulary-map buffers are not parameters: the head's ids -> target ids.
    d2t, t2d = got.pop("d2t", None), got.pop("t2d", None)
    if spec.draft_vocab_size and spec.draft_vocab_size != spec.vocab_size:
        draft_vocab = read_draft_vocab(d2t, t2d, spec.draft_vocab_size, spec.vocab_size)
    else:
        draft_vocab = DraftVocab(None, spec.vocab_size)
    load_strict(model, got, "drafter", f"a {spec.format} {spec.kind} drafter")
    spec.weights = {}  # the network holds them now
    model.draft_vocab = draft_vocab
    # the Markov embedding stays: one gather a slot, not four
    quantize(model, bits, group_size, keep=lambda path, m: path == "markov_head.markov_w1")
    if split_attention():
        for layer in model.layers:
            layer.self_attn.fold_rows = True
    return model
