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

One call drafts several rows (`ContextBackbone.backbone_rows`; `ContextRows` in
draft_context.py): every row's context K/V sit in one left-padded batched cache per layer, each
row roped at its own positions and its padding masked, so each row's hidden states are those it
gets alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ...core.cpu_fusion import fuse_for_cpu
from ...core.device import split_attention
from ...core.draft_vocab import DraftVocab, read_draft_vocab
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from .draft_context import ContextCache
from .drafter_weights import load_strict, quantize


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

    def take_in(self, context: mx.array | None, cache: ContextCache, kv=None) -> tuple:
        """Append the call's context rows' K/V to `cache` (`kv` computes them: `_kv` unless
        given) -> every context K/V the block attends to (None, None: none yet)."""
        if context is not None and context.shape[1] > 0:
            ck, cv = (kv or self._kv)(context, cache.offset)
            return cache.append(ck, cv)
        return cache.fetch()

    def project(self, x: mx.array, offset) -> tuple:
        """The block's queries, gate (None where the layer has none), keys and values."""
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1)
        gate = None
        if self.gated:  # the gate is not normed (mlx-lm's Qwen3NextAttention reads it so too)
            q, gate = mx.split(q, 2, axis=-1)
        q = self.rope(self.q_norm(q).transpose(0, 2, 1, 3), offset=offset)
        bk, bv = self._kv(x, offset)
        return q, gate, bk, bv

    def attend(self, q, bk, bv, keys, values, cache: ContextCache) -> mx.array:
        """The block's attention over the context K/V and its own -> [b, heads, n, head dim]."""
        b, _, n, _ = q.shape
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
            return out.reshape(b, self.n_heads, n, -1)
        return mx.fast.scaled_dot_product_attention(
            q, bk, bv, scale=self.scale, mask=mask, sinks=sinks
        )

    def finish(self, out: mx.array, gate: mx.array | None) -> mx.array:
        """The attention's output [b, heads, n, head dim] through the gate and `o_proj`."""
        b, _, n, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, n, -1)
        if gate is not None:
            out = out * mx.sigmoid(gate.reshape(b, n, -1))
        return self.o_proj(out)

    def __call__(self, x: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        keys, values = self.take_in(context, cache)
        q, gate, bk, bv = self.project(x, cache.offset)  # block slot k sits at offset + k
        return self.finish(self.attend(q, bk, bv, keys, values, cache), gate)


class DraftMLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    # Set on the instance where the drafter runs compiled (compiled_drafter.py): a plain
    # attribute, so the layer's parameters and their names stay as they are.
    compiled = None

    def __init__(self, spec: DrafterSpec, layer_type: str = "full_attention"):
        super().__init__()
        self.self_attn = DraftAttention(spec, layer_type)
        self.mlp = DraftMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def __call__(self, h: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        if self.compiled is not None:
            return self.compiled(h, context, cache)
        return self.eager(h, context, cache)

    def eager(self, h: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        """The layer op by op (what a compiled layer computes, and its path for batched rows)."""
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
            widest = max(counts)
            if min(counts) == widest:  # no row is padded
                context = rows.reshape(len(counts), widest, rows.shape[-1])
            else:  # one gather of every row's rows and a zero row for its padding: a GPU
                # pays per launch, and per-row slices, pads and a stack grow with the rows
                rows = mx.concatenate([rows, mx.zeros((1, rows.shape[-1]), dtype=rows.dtype)])
                context = rows[mx.array(padded_index(counts, widest))]
        h = block
        for layer, c in zip(self.layers, cache):
            h = layer(h, context, c)
        return self.norm(h)


def padded_index(counts: list[int], widest: int) -> list[list[int]]:
    """For rows of counts[i] context rows laid one after another (then one zero row), the
    index of each row's `widest` slots: its own rows, then the zero row as padding."""
    zero, at, out = sum(counts), 0, []
    for n in counts:
        out.append(list(range(at, at + n)) + [zero] * (widest - n))
        at += n
    return out


class BlockDrafter(ContextBackbone, nn.Module):
    """DSpark / DFlash drafter network; its parameter names are the canonical tensor names."""

    # Whether its proposers run DSpark's greedy chain compiled (set by compiled_drafter.py)
    compiled_chain = False

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
    fuse_for_cpu(model)  # MLX's CPU backend runs norms and ropes unfused
    from .compiled_drafter import install  # it builds on this module

    install(model)  # last: it compiles the modules as they now are
    return model
