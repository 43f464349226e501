"""RMSNorm and RoPE fused by `mx.compile` on MLX's CPU backend, bit-identical to MLX's own.

On a GPU `mx.fast.rms_norm` and `mx.fast.rope` are one kernel each. On MLX's CPU backend
(0.32) they run as their unfused fallbacks instead, built op by op into the graph: 14 nodes
for an RMSNorm and 29 for a RoPE (frequencies, positions, cos, sin, the rotation). A decoder
layer of Qwen3 calls four norms and two ropes, about 110 of the ~160 nodes it adds to a
one-token forward, and a small model's CPU step is bound by dispatching nodes, not by their
arithmetic: the demo target's plain step is ~1,270 nodes and 6-9 ms on two cores, its
compute microseconds.

`mx.compile` traces the same fallback and fuses its elementwise runs, so the norm becomes ~3
nodes and the rope ~8, computed by the same operations in the same order: the outputs are
bit-identical (checked on a sample before anything is swapped, and by tests over dtypes,
shapes, partial rotary dims and per-row offsets). Plain decoding, every mode and the
benchmark's mlx-lm arm run the same swapped modules (they share the loaded instance).

The swap replaces exact `nn.RMSNorm`, `nn.RoPE` and mlx-lm `Llama3RoPE` instances in one
loaded model's tree with subclasses of them (parameter paths, attributes and `isinstance`
unchanged); classes of other libraries are never touched. Other norm and rope variants
(Gemma's 1 + w norm, YaRN and the other scaled ropes) keep MLX's path.
`OUTRIDER_CPU_FUSION=off` keeps MLX's path everywhere; a GPU never swaps (its fast ops are
single kernels already).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from .env import env_choice
from .wrapper import children

FUSION_ENV = "OUTRIDER_CPU_FUSION"


def cpu_fusion() -> bool:
    """Whether loaded models get the fused modules: MLX's default device is the CPU and
    OUTRIDER_CPU_FUSION is `on` (the default), not `off`."""
    return env_choice(FUSION_ENV, ("on", "off")) == "on" and mx.default_device() == mx.cpu


class FusedRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose fallback graph is compiled (shape-agnostic: one trace serves every
    row count); its weight stays a parameter at the same path."""

    def __init__(self, norm: nn.RMSNorm, fused: Callable | None = None) -> None:
        nn.Module.__init__(self)
        self.weight = norm.weight
        self.eps = norm.eps
        self._fused = fused or compiled_norm(norm.eps)

    def __call__(self, x: mx.array) -> mx.array:
        return self._fused(x, self.weight)

    def __deepcopy__(self, memo: dict) -> FusedRMSNorm:  # a compiled function does not copy
        norm = nn.RMSNorm(self.weight.shape[-1], eps=self.eps)
        norm.weight = copy.deepcopy(self.weight, memo)
        return FusedRMSNorm(norm)


FUSED_ROWS = 64  # ropes of more rows (a prompt's chunks) keep MLX's path


class FusedRoPE(nn.RoPE):
    """`nn.RoPE` whose fallback graph is compiled, for up to FUSED_ROWS rows: a decode step,
    a verify, a short prefix-hit tail. The trace is per input shape (the positions depend on
    the row count), so a prompt's chunks of every length would each leave one behind in a
    long-running server; there a rope is a sliver of a wide forward, and MLX's own path runs
    it. The offset goes in as an array, so a new position is not a new trace."""

    def __init__(self, rope: nn.RoPE, fused: Callable | None = None) -> None:
        nn.Module.__init__(self)
        self.dims, self.traditional = rope.dims, rope.traditional
        self.base, self.scale = rope.base, rope.scale
        self._fused = fused or compiled_rope(*_rope_settings(rope))

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.shape[-2] > FUSED_ROWS:
            return super().__call__(x, offset)
        return self._fused(x, _as_array(offset))

    def __deepcopy__(self, memo: dict) -> FusedRoPE:
        return FusedRoPE(nn.RoPE(self.dims, self.traditional, self.base, self.scale))


class FusedLlama3RoPE(Llama3RoPE):
    """mlx-lm's `Llama3RoPE` (Llama 3.1 and later: a frequency table instead of a base) with
    its fallback compiled; the table goes in as an input."""

    def __init__(self, rope: Llama3RoPE, fused: Callable | None = None) -> None:
        nn.Module.__init__(self)
        self.dims, self.traditional = rope.dims, rope.traditional
        self.max_position_embeddings = rope.max_position_embeddings
        self._freqs = rope._freqs
        self._fused = fused or compiled_table_rope(rope.dims, rope.traditional)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.shape[-2] > FUSED_ROWS:  # as FusedRoPE
            return super().__call__(x, offset)
        return self._fused(x, _as_array(offset), self._freqs)

    def __deepcopy__(self, memo: dict) -> FusedLlama3RoPE:
        return FusedLlama3RoPE(self)  # the table is never written: shared


def _as_array(offset: int | mx.array) -> mx.array:
    """A rope's offset as the compiled function takes it: an array, so that a new position
    is not a new trace."""
    return offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)


def compiled_norm(eps: float) -> Callable:
    return mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps), shapeless=True)


def compiled_rope(dims: int, traditional: bool, base: float, scale: float) -> Callable:
    def rope(x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    return mx.compile(rope)


def compiled_table_rope(dims: int, traditional: bool) -> Callable:
    def rope(x: mx.array, offset: mx.array, freqs: mx.array) -> mx.array:
        return mx.fast.rope(
            x, dims, traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs
        )

    return mx.compile(rope)


def _rope_settings(rope: nn.RoPE) -> tuple:
    return rope.dims, rope.traditional, rope.base, rope.scale


class _Fuser:
    """The fused modules of one model: one compiled function per setting, shared by every
    module of it (a shape is traced once for all of a model's norms, not once per layer),
    each setting checked against MLX's own before its first swap (`same_as_mlx`)."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Callable] = {}  # (kind, setting) -> compiled function
        self.checked: dict[tuple, bool] = {}  # (kind, what the check covers) -> passed

    def replacement(self, module: Any) -> nn.Module | None:
        kind = type(module)
        if kind is nn.RMSNorm:
            setting: tuple = (module.eps,)
            make, fused_kind, checked = compiled_norm, FusedRMSNorm, setting
        elif kind is nn.RoPE:
            setting = _rope_settings(module)
            make, fused_kind, checked = compiled_rope, FusedRoPE, setting
        elif kind is Llama3RoPE:  # one compiled function, each table checked
            setting = (module.dims, module.traditional)
            make, fused_kind = compiled_table_rope, FusedLlama3RoPE
            checked = (*setting, id(module._freqs))
        else:
            return None
        if (kind, setting) not in self.compiled:
            self.compiled[kind, setting] = make(*setting)
        new = fused_kind(module, self.compiled[kind, setting])
        if (kind, checked) not in self.checked:
            self.checked[kind, checked] = same_as_mlx(new, module)
        return new if self.checked[kind, checked] else None


def same_as_mlx(fused: nn.Module, original: nn.Module) -> bool:
    """Whether `fused` gives `original`'s output bit for bit on a sample of its inputs (two
    row counts, a position past the start)."""
    try:
        if isinstance(original, nn.RMSNorm):
            size = original.weight.shape[-1]
            samples = [(mx.random.normal((1, n, size), key=mx.random.key(n)),) for n in (1, 5)]
        else:  # a rope: heads moved ahead of the rows, as attention hands them over (strided)
            size = 2 * ((original.dims + 1) // 2)
            samples = [
                (mx.random.normal((1, n, 2, size), key=mx.random.key(n)).transpose(0, 2, 1, 3), 37)
                for n in (1, 5)
            ]
        for args in samples:
            want, got = original(*args), fused(*args)
            if want.shape != got.shape or not mx.array_equal(want, got).item():
                return False
        return True
    except Exception:  # a compile this MLX cannot do: keep MLX's path
        return False


def fuse_for_cpu(model: nn.Module) -> int:
    """Swap `model`'s exact `nn.RMSNorm`, `nn.RoPE` and `Llama3RoPE` instances for fused ones where
    `cpu_fusion()` says so; returns how many were swapped. The first module of each setting
    is checked against MLX's own first (`same_as_mlx`): a setting that differs keeps MLX's
    path."""
    if not cpu_fusion():
        return 0
    replacement = _Fuser().replacement
    swapped = 0

    def visit(module: nn.Module) -> None:
        nonlocal swapped
        for holder, key, child in children(module):
            new = replacement(child)
            if new is None:
                visit(child)
            else:
                holder[key] = new
                swapped += 1

    visit(model)
    return swapped
