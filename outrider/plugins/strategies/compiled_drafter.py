"""A block drafter's fixed-shape parts compiled (`mx.compile`), for the host's sake, as the
target's layers are (core/compiled_layers.py says why: on MLX's CUDA backend a call of a few
rows is the host building and launching its kernels, not the GPU computing them).

A drafter call is small and runs once a round: on the demo pair on an H100 a DFlash call took
about 1.0 ms synced against a 1.0 ms plain step of the 8-layer target (docs/performance.md,
"A plain step's cost: a median"), and DSpark's sequential head adds a handful of kernels a
slot. Compiled here, for one sequence's calls (one row; batched rows keep the eager path, so
the traces stay few):

- each `DraftLayer`'s context K/V (calls taking in at most `MAX_ROWS` context rows: a prompt's
  or a parked run's catch-up keeps the eager path), its block's input norm, q/k/v, norms and
  ropes (`pre`), and its output projection, residuals, post-attention norm and MLP (`tail`);
  the context cache's update, the mask and the attention stay eager;
- DSpark's greedy chain (`BlockProposer._greedy_chain`): every slot's Markov bias, confidence
  and argmax in one trace a block width.

Drafts never change what is output (the target verifies them), so this is a matter of speed;
the tests still hold the compiled drafts to the eager ones. Layers of other drafters
(DFlash 2's convolutions, Gemma-4's, EAGLE-3's) keep their own path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from ...core.compiled_layers import MAX_ROWS, Compiled, Positions, compiled_layers
from .block_drafter import BlockDrafter, DraftLayer
from .draft_context import ContextCache


class CompiledDraftLayer:
    """The compiled parts of one `DraftLayer`, which calls this in place of its own forward
    (`DraftLayer.compiled`)."""

    def __init__(self, layer: DraftLayer) -> None:
        self.layer = layer
        a = layer.self_attn
        self._positions = Positions()
        self._context_kv = Compiled(a._kv, [a.k_proj, a.k_norm, a.v_proj, a.rope])
        self._pre = Compiled(
            self._traced_pre,
            [layer.input_layernorm, a.q_proj, a.q_norm, a.k_proj, a.k_norm, a.v_proj, a.rope],
        )
        self._tail = Compiled(
            self._traced_tail, [a.o_proj, layer.post_attention_layernorm, layer.mlp]
        )  # fmt: skip

    def _traced_pre(self, h: mx.array, offset: mx.array) -> tuple:
        return self.layer.self_attn.project(self.layer.input_layernorm(h), offset)

    def _traced_tail(self, h: mx.array, attended: mx.array, gate: mx.array | None) -> mx.array:
        layer = self.layer
        h = h + layer.self_attn.finish(attended, gate)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _context(self, context: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        """The context rows' K/V, compiled (`DraftAttention.take_in` asks for them)."""
        return self._context_kv(context, self._offset(offset))

    def _offset(self, offset: Any) -> mx.array:
        """A cache's offset as an array (one trace for every position): a row cache's already
        is one."""
        return offset if isinstance(offset, mx.array) else self._positions(offset)

    def __call__(self, h: mx.array, context: mx.array | None, cache: Any) -> mx.array:
        layer = self.layer
        if h.shape[0] != 1 or h.shape[1] > MAX_ROWS:  # batched rows: the layer's own path
            return layer.eager(h, context, cache)
        a = layer.self_attn
        few = context is not None and context.shape[0] == 1 and context.shape[1] <= MAX_ROWS
        keys, values = a.take_in(context, cache, self._context if few else None)
        q, gate, bk, bv = self._pre(h, self._offset(cache.offset))
        return self._tail(h, a.attend(q, bk, bv, keys, values, cache), gate)


def install(drafter: BlockDrafter) -> int:
    """Compile `drafter`'s `DraftLayer`s where `compiled_layers()` says so (a CUDA GPU by
    default; OUTRIDER_COMPILED_LAYERS) and mark it for its proposers' greedy chains
    (`greedy_chain`), unless a layer's compiled call fails or computes something else than its
    own (`_agrees`). Returns how many layers run compiled."""
    if not compiled_layers() or not isinstance(drafter, BlockDrafter):
        return 0
    layers = [x for x in drafter.layers if type(x) is DraftLayer]  # others keep their own
    if not layers or len(layers) != len(drafter.layers):
        return 0
    parts = [CompiledDraftLayer(layer) for layer in layers]
    if not all(_agrees(layer, compiled) for layer, compiled in zip(layers, parts)):
        return 0
    for layer, compiled in zip(layers, parts):
        layer.compiled = compiled
    drafter.compiled_chain = True
    return len(layers)


def _agrees(layer: DraftLayer, compiled: CompiledDraftLayer) -> bool:
    """Whether a call taking in 3 context rows and running a block of 4, compiled, gives the
    layer's own output, to a rounding (fused elementwise kernels may round otherwise in half
    precision; a wrong position or weight moves it by its whole scale)."""
    norm = layer.input_layernorm.weight
    keys = mx.random.split(mx.random.key(7))
    h = mx.random.normal((1, 4, norm.shape[0]), key=keys[0]).astype(norm.dtype)
    context = mx.random.normal((1, 3, norm.shape[0]), key=keys[1]).astype(norm.dtype)
    try:
        want = layer.eager(h, context, ContextCache())
        got = compiled(h, context, ContextCache())
        mx.eval(want, got)
    except Exception:  # a trace this MLX cannot make: the layer's own path
        return False
    scale = mx.abs(want).max().item()
    return mx.abs(got - want).max().item() <= 0.02 * scale


def greedy_chain(proposer: Any) -> Compiled:
    """`proposer`'s greedy chain (`BlockProposer._greedy_chain`) compiled, the Markov and
    confidence heads' weights as its inputs; the proposer runs it where its drafter says so
    (`compiled_chain`, set by `install`)."""
    drafter = proposer.drafter
    heads = [drafter[k] for k in ("markov_head", "confidence_head") if k in drafter]
    return Compiled(proposer._greedy_chain, heads)


@contextmanager
def bypassed(drafter: BlockDrafter) -> Iterator[None]:
    """`drafter`'s layers and its proposers' greedy chains on their own path for the duration
    (a benchmark's uncompiled arm)."""
    held = [(layer, layer.compiled) for layer in drafter.layers if isinstance(layer, DraftLayer)]
    chain = drafter.compiled_chain
    for layer, _ in held:
        layer.compiled = None
    drafter.compiled_chain = False
    try:
        yield
    finally:
        for layer, compiled in held:
            layer.compiled = compiled
        drafter.compiled_chain = chain
