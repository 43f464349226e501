"""Decoder layers whose fixed-shape parts run compiled (`mx.compile`), for the host's sake.

On MLX's CUDA backend a step of a few rows is the host's time, not the GPU's: the device waited
2-5 µs for each token while Python built the step's graph and MLX encoded and launched its
kernels (benchmarks/plain_step.py). `mx.compile` replays a traced function from C++ instead of
running it op by op in Python, and fuses elementwise runs. In a dense decoder layer everything
but the KV cache update and the attention over the growing cache has one shape for every step
of a given width, so a layer here runs as

- `pre(x, position)`: the input norm, the q/k/v projections, the q/k norms where the layer has
  them, and both ropes (the position is an array input, so one trace serves every step);
- the cache update and the attention, eager, as before (a rerouted verify's attention too:
  plugins/targets/verify_attention.py hands over its choice through `attention_for`);
- `tail(x, attention)`: the output projection, the residual, the post-attention norm, the MLP
  and its residual.

What it buys is host time. On an H100 (`benchmarks/compiled_blocks.py`, docs/performance.md,
"Compiled layers"), building a one-row step's graph took 1.04-1.25 ms against 1.45-1.73 for
the Qwen3-0.6B shape, and the step ran 1.15-1.39x as fast. Through outrider the demo target's
step ran 1.06x as fast. On the 8B shapes runs read 0.92-1.10x, inside that host's noise (the
bf16 step is close to the time its weights take to read).

The layers are the mlx-lm blocks of llama, qwen2 and qwen3 (mistral loads as llama), each
wrapped on the one loaded instance (`CompiledLayer`; classes are never touched). One sequence's
calls of up to MAX_ROWS rows over a plain KV cache (decoding steps and verifies) take the
compiled path; a prefill chunk, a batch of rows and any other cache take the layer's own, so
the traces stay few (one per width). A layer's weights go into its compiled parts as inputs,
read afresh every call, so weights changed after load (a cast, an update) are the ones the next
call computes with; modules swapped after load are not seen, so `install` comes last at load,
and a deep copy of the model (a training teacher's) holds the layers themselves. `install`
keeps the wrappers only where a short prefill, an 8-row verify and one-row steps give the
model's own logits bit for bit. MLX keys a trace by the calling thread's stream too, so a
server's worker thread makes its own.

`Compiled` is the mechanism (a function compiled with some modules' weights as its inputs); a
block drafter's layers and DSpark's sequential head use it too
(plugins/strategies/compiled_drafter.py).

OUTRIDER_COMPILED_LAYERS: `auto` (the default) compiles on a CUDA GPU; `on` on any device (the
CPU tests use it; the CPU's norms and ropes are fused already, core/cpu_fusion.py); `off` never.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from .device import on_cuda_gpu
from .env import env_choice
from .errors import UnsupportedTargetError
from .wrapper import PassThrough, children

ENV = "OUTRIDER_COMPILED_LAYERS"
# Widest call that takes the compiled path: every verify width (core/calibration.py MAX_WIDTH).
# A prefill chunk's rows vary in number from request to request, and each new shape costs a
# trace (all layers: tens of milliseconds), so prefill keeps the layer's own path.
MAX_ROWS = 16
# mlx_lm.models.<module>.TransformerBlock layers laid out as `CompiledLayer` re-states them
BLOCKS = ("llama", "qwen2", "qwen3")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
PRE = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope")  # what `pre` reads of them


def compiled_layers() -> bool:
    """Whether loaded dense targets get compiled layers (OUTRIDER_COMPILED_LAYERS, above)."""
    choice = env_choice(ENV, ("auto", "on", "off"))
    return choice == "on" or (choice == "auto" and on_cuda_gpu())


class Positions:
    """A step's rope position as an int32 array, made once and read by every layer."""

    def __init__(self) -> None:
        self._offset: int | None = None
        self._array: mx.array | None = None

    def __call__(self, offset: int) -> mx.array:
        if offset != self._offset or self._array is None:
            self._offset, self._array = offset, mx.array(offset, dtype=mx.int32)
        return self._array


class CompiledLayer(PassThrough):
    """One mlx-lm dense decoder layer of one model instance with `pre` and `tail` compiled."""

    wrapped = "layer"
    route = "compiled"

    def __init__(self, layer: nn.Module, positions: Positions) -> None:
        super().__init__()
        self.layer = layer
        self._positions = positions
        a = _raw(layer.self_attn)
        self._pre = Compiled(
            self._traced_pre, [layer.input_layernorm] + [a[k] for k in PRE if k in a]
        )  # fmt: skip
        self._tail = Compiled(
            self._traced_tail, [a.o_proj, layer.post_attention_layernorm, layer.mlp]
        )  # fmt: skip

    def __deepcopy__(self, memo: dict) -> nn.Module:
        # a copy of the model holds the layer itself: a training teacher's copy is made dense
        # (its modules swapped), which a compiled layer's slots would not follow
        return copy.deepcopy(self.layer, memo)

    def _traced_pre(self, x: mx.array, position: mx.array) -> tuple:
        layer = self.layer
        a = _raw(layer.self_attn)  # the projections behind a rerouting wrapper
        b, n, _ = x.shape
        h = layer.input_layernorm(x)
        q = a.q_proj(h).reshape(b, n, a.n_heads, -1)
        k = a.k_proj(h).reshape(b, n, a.n_kv_heads, -1)
        if "q_norm" in a:
            q, k = a.q_norm(q), a.k_norm(k)
        v = a.v_proj(h).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = a.rope(q.transpose(0, 2, 1, 3), offset=position)
        k = a.rope(k.transpose(0, 2, 1, 3), offset=position)
        return q, k, v

    def _traced_tail(self, x: mx.array, attended: mx.array) -> mx.array:
        layer = self.layer
        b, n, _ = x.shape
        o = _raw(layer.self_attn).o_proj(attended.transpose(0, 2, 1, 3).reshape(b, n, -1))
        h = x + o
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if x.shape[0] != 1 or x.shape[1] > MAX_ROWS or type(cache) is not KVCache:
            return self.layer(x, mask, cache)
        a = self.layer.self_attn
        # a rerouted verify's attention (it may lay out the cache's room first), else mlx-lm's
        plan = getattr(a, "attention_for", None)
        attend = plan(x, mask, cache) if plan is not None else None
        q, k, v = self._pre(x, self._positions(cache.offset))
        keys, values = cache.update_and_fetch(k, v)
        if attend is None:
            out = scaled_dot_product_attention(
                q, keys, values, cache=cache, scale=a.scale, mask=mask
            )
        else:
            out = attend(q, keys, values)
        return self._tail(x, out)


class Compiled:
    """`fn` compiled (`mx.compile`), with the arrays of `modules` as inputs of every call: a
    trace keeps no weight as a constant, so what the modules hold when a call is made (after a
    cast, an update) is what it computes with. `fn` reads the modules as usual; while it is
    traced they hold the trace's inputs. Arguments that are not arrays (ints, None) are
    constants of a trace: each new value makes another."""

    def __init__(self, fn: Callable[..., Any], modules: list) -> None:
        self._fn = fn
        self._slots = _slots(modules)
        self._compiled = mx.compile(self._traced)

    def _traced(self, *inputs: Any) -> Any:
        split = len(inputs) - len(self._slots)
        with _holding(self._slots, inputs[split:]):
            return self._fn(*inputs[:split])

    def __call__(self, *args: Any) -> Any:
        return self._compiled(*args, *[holder[key] for holder, key in self._slots])


def _slots(tree: Any) -> list[tuple[Any, Any]]:
    """(holder, key) of every array in `tree` (modules, their dicts and lists), in order."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, mx.array):
            out.append((tree, key))
        elif isinstance(value, (dict, list)):
            out += _slots(value)
    return out


@contextmanager
def _holding(slots: list[tuple[Any, Any]], arrays: tuple) -> Iterator[None]:
    """`arrays` in `slots` while a trace runs (the trace's inputs), the real ones after."""
    real = [holder[key] for holder, key in slots]
    for (holder, key), array in zip(slots, arrays, strict=True):
        holder[key] = array
    try:
        yield
    finally:
        for (holder, key), array in zip(slots, real):
            holder[key] = array


def _raw(module: nn.Module) -> nn.Module:
    """The module behind any pass-through wrappers in front of it."""
    while isinstance(module, PassThrough):
        module = module[type(module).wrapped]
    return module


def fits(layer: nn.Module) -> bool:
    """Whether `layer` is an mlx-lm dense block `CompiledLayer` re-states exactly."""
    kind = type(layer)
    if kind.__name__ != "TransformerBlock" or kind.__module__.rsplit(".", 1)[-1] not in BLOCKS:
        return False
    if not all(name in layer for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False
    attention = layer.get("self_attn")
    attention = _raw(attention) if isinstance(attention, nn.Module) else None
    if attention is None or type(attention).__name__ != "Attention":
        return False
    if not all(name in attention for name in ATTENTION):
        return False
    if ("q_norm" in attention) != ("k_norm" in attention):
        return False
    return all(hasattr(attention, name) for name in ("n_heads", "n_kv_heads", "scale"))


def install(model: nn.Module, family: Any) -> int:
    """Put a `CompiledLayer` in front of every layer of `model`'s decoder list (the target
    family's `layers`) where `compiled_layers()` says so and every layer fits, and keep them
    only if they give the model's own logits bit for bit (`_probe`). A family with no layer
    list of its own (the mlx-lm fallback) keeps its model as it is. Returns how many stay."""
    if not compiled_layers():
        return 0
    try:
        layers = family.layers(model)
    except UnsupportedTargetError:
        return 0
    if not layers or not all(fits(layer) for layer in layers):
        return 0

    def make_cache() -> list:
        return family.make_cache(model)

    reference = _probe(model, make_cache)
    positions = Positions()
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = CompiledLayer(layer, positions)
    try:
        agrees = all(
            mx.array_equal(a, b).item() for a, b in zip(_probe(model, make_cache), reference)
        )
    except Exception:  # a trace this MLX cannot make: the layers' own path
        agrees = False
    if not agrees:
        layers[:] = originals
        return 0
    return len(layers)


@contextmanager
def bypassed(model: nn.Module) -> Iterator[None]:
    """`model`'s own layers in place of its compiled ones (behind taps too) for the duration:
    a benchmark's mlx-lm arm measures mlx-lm's layers, not these. Any model will do: one with
    no compiled layers is left as it is."""
    swaps = []

    def visit(module: nn.Module) -> None:
        for holder, slot, child in children(module):
            if isinstance(child, CompiledLayer):
                swaps.append((holder, slot, child))
                holder[slot] = child.layer
            else:
                visit(child)

    visit(model)
    try:
        yield
    finally:
        for holder, slot, layer in swaps:
            holder[slot] = layer


def _probe(model: nn.Module, make_cache: Callable[[], list]) -> list[mx.array]:
    """Logits of a 4-row prefill, an 8-row verify and three one-row steps, in order."""
    cache = make_cache()
    out = []
    done = 0
    for rows in (4, 8, 1, 1, 1):
        ids = [1 + (done + i) % 32 for i in range(rows)]  # 1..32, as in any vocabulary
        logits = model(mx.array([ids], dtype=mx.uint32), cache=cache)
        mx.eval(logits)
        out.append(logits)
        done += rows
    return out
