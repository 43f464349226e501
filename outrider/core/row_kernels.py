"""Quantized products of a few rows through a kernel of outrider's own (or a plugin's).

A verify forward multiplies 1 + cap rows by every weight matrix, and a backend may read the
weights once per row there (MLX 0.32's CUDA backend does for 2-7 rows). A `RowsKernel` reads
them once for all rows. Kernels come from plugins (`register_matmul_kernels`; the built-in one
is CUDA's, plugins/kernels/cuda_rows.py), so a Metal one can plug in beside it.

`QuantizedRows` stands in front of one of MLX's `QuantizedLinear` layers and sends products of
`kernel.min_rows` to `kernel.max_rows` rows (more where the kernel's `rows_up_to` says) to the
kernel, others (one row, a prefill) to the layer itself; sibling layers that read one input
(q, k and v; gate and up) form a `RowsGroup` whose products take one launch, where the kernel
has a grouped form.
`install` puts it in front of every layer a kernel takes after `probe` has checked, per
distinct shape, that the kernel computes what MLX's own product computes; a kernel that fails
to build or to agree is not used (`OUTRIDER_MATMUL`, core/device.py, says whether to try).

A kernel may also say from how many rows a product runs faster as the weight dequantized and
multiplied in the activations' type (`dense_rows`): MLX 0.32's CUDA product of 4-bit weights
by a prefill chunk's hundreds of rows is 2-3x slower than that (docs/performance.md,
"Prefill of quantized targets"), so such products take the dense route. The host queues work
far ahead of the device and every dense weight queued stays allocated until its product has
run, so a model's dense products share a `DenseQueue` that waits for the device once a bound
of dense bytes is queued.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from .wrapper import PassThrough

# How far a kernel's product may part from MLX's, relative to the product's largest value:
# the sums run in another order (float32 rounding), and a half-precision result rounds to its
# 8- or 11-bit mantissa; a wrong layout or group parts them by O(1).
PROBE_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}


class RowsKernel(Protocol):
    """What a plugin registers: a quantized product of `min_rows` to `max_rows` rows (fewer
    or more run MLX's own). A kernel may also have `groups(width, bits, group_size, dtype)`
    and `grouped(x, [(w, scales, biases), ...], group_size, bits) -> [y, ...]`: several
    products of one input in one launch, which `install` uses for sibling layers (`GROUPS`)."""

    name: str
    min_rows: int
    max_rows: int

    def available(self) -> bool:
        """Whether the kernel can run here (its device, its MLX build)."""

    def supports(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """Whether it computes a product of input width `width`, `bits`-bit weights in groups
        of `group_size`, activations of `dtype`."""

    def preferred(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """Whether it was measured faster than MLX's own product here, so `auto` uses it."""

    # Optional: def dense_rows(width, bits, group_size, dtype) -> int | None, the rows from
    # which the product runs faster dequantized (`dense`) than as MLX's quantized product
    # (None or absent: never); def rows_up_to(width, outputs, bits, group_size, dtype) -> int,
    # the most rows it takes at that shape (outputs: the weight's rows, or a group's in all),
    # where that is more than `max_rows`.

    def __call__(
        self,
        x: mx.array,
        w: mx.array,
        scales: mx.array,
        biases: mx.array,
        group_size: int,
        bits: int,
    ) -> mx.array:
        """x @ dequantize(w, scales, biases).T for x [..., width] of at most max_rows rows."""


class QuantizedRows(PassThrough):
    """A quantized linear layer whose products of `kernel.min_rows` to `max_rows` rows (the
    kernel's `max_rows` unless `rows_limit` says more) run the kernel (with the rest of its
    `RowsGroup`, where it has one), products of `dense_from` rows or more the dequantized
    weight (`dense`), and others the layer's own."""

    wrapped = "linear"
    route = "rows"

    def __init__(
        self,
        linear: nn.QuantizedLinear,
        kernel: RowsKernel,
        dense_from: int | None = None,
        queue: DenseQueue | None = None,
        max_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.linear = linear
        self._kernel = kernel
        self._group: RowsGroup | None = None  # set by `install`
        self._index = 0
        self.dense_from = dense_from
        self.queue = queue  # the model's, shared by its layers
        self.max_rows = kernel.max_rows if max_rows is None else max_rows

    def __call__(self, x: mx.array) -> mx.array:
        lin, kernel = self.linear, self._kernel
        rows = x.size // x.shape[-1]
        if self.dense_from is not None and rows >= self.dense_from:
            y = dense(lin, x)
            if self.queue is not None:
                self.queue.add(lin.weight.shape[0] * width(lin) * x.dtype.size, y)
            return y
        if rows > self.max_rows or rows < kernel.min_rows:
            return lin(x)
        if self._group is not None:
            y = self._group.output(x, self._index)
        else:
            y = kernel(x, lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
        return y + lin.bias if "bias" in lin else y


# Bytes of dense weights a model's products may queue before one waits for the device. Without
# a bound a 4-bit 32B shape's prefill of 4,096 tokens held 12 GB more at its peak than through
# MLX's own products (docs/performance.md, "Prefill of quantized targets").
DENSE_QUEUE_BYTES = 2 << 30


class DenseQueue:
    """The dense weights a model's products have queued and not yet waited for: once
    `limit` bytes are queued, the product that passed it is evaluated (its forward so far
    runs) and the count starts again, so about `limit` bytes of dense weights are alive at
    once, at the cost of one wait per `limit` bytes."""

    def __init__(self, limit: int = DENSE_QUEUE_BYTES) -> None:
        self.limit = limit
        self.queued = 0
        self.waits = 0

    def add(self, nbytes: int, y: mx.array) -> None:
        self.queued += nbytes
        if self.queued >= self.limit:
            mx.eval(y)
            self.queued = 0
            self.waits += 1


def dense(lin: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """The layer's product of x through its weight dequantized to x's type: the same values as
    its quantized product (each weight dequantized, then a dense product), in another order of
    work. The dense weight lives only until its product has run."""
    w = mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
    y = x @ w.astype(x.dtype).T
    return y + lin.bias if "bias" in lin else y


def rows_limit(kernel: RowsKernel, members: list[nn.QuantizedLinear], dtype: mx.Dtype) -> int:
    """The most rows the kernel takes in one launch computing `members` (one layer, or a
    group's layers of one input): its `rows_up_to` at their weight rows in all, where it says
    more than `max_rows`."""
    up_to = getattr(kernel, "rows_up_to", None)
    if not callable(up_to):
        return kernel.max_rows
    first = members[0]
    outputs = sum(m.weight.shape[0] for m in members)
    return max(kernel.max_rows, up_to(width(first), outputs, first.bits, first.group_size, dtype))


def dense_from(kernel: RowsKernel, layer: nn.QuantizedLinear, dtype: mx.Dtype) -> int | None:
    """From how many rows the kernel says `layer`'s products run faster dequantized."""
    rows = getattr(kernel, "dense_rows", None)
    if not callable(rows):
        return None
    return rows(width(layer), layer.bits, layer.group_size, dtype)


# Sibling layers a decoder layer calls one after another on the same input (mlx-lm's
# attention and MLP modules, and outrider's attention wrapper): one kernel launch computes all.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class RowsGroup:
    """Layers that read the same input, their few-row products computed in one launch
    (`kernel.grouped`): the first member called with an input computes every member's product
    of it, and the others, called with that same array, take theirs. A member called with
    another array computes the group's products of that one; nothing is held once every
    member has taken its product."""

    def __init__(self, kernel: RowsKernel, members: list[nn.QuantizedLinear]) -> None:
        self.kernel = kernel
        self.members = members
        self._x: mx.array | None = None
        self._outputs: list[mx.array] = []
        self._left: set[int] = set()

    def output(self, x: mx.array, index: int) -> mx.array:
        if x is not self._x:
            first = self.members[0]
            weights = [(m.weight, m.scales, m.biases) for m in self.members]
            self._outputs = self.kernel.grouped(x, weights, first.group_size, first.bits)
            self._x, self._left = x, set(range(len(self.members)))
        y = self._outputs[index]
        self._left.discard(index)
        if not self._left:
            self._x, self._outputs = None, []
        return y


def width(layer: nn.QuantizedLinear) -> int:
    """The input width of a quantized linear layer."""
    return layer.weight.shape[-1] * 32 // layer.bits


def eligible(module: nn.Module, kernel: RowsKernel, dtype: mx.Dtype) -> bool:
    """MLX's own affine-quantized linear layer (not a subclass, which may add to its call) at a
    shape `kernel` takes for activations of `dtype`."""
    if type(module) is not nn.QuantizedLinear or getattr(module, "mode", "affine") != "affine":
        return False
    return kernel.supports(width(module), module.bits, module.group_size, dtype)


def layers(model: nn.Module, kernel: RowsKernel, dtype: mx.Dtype) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer of `model` the kernel would stand in front of."""
    return [(n, m) for n, m in model.named_modules() if eligible(m, kernel, dtype)]


def probe(
    found: Iterable[nn.Module], kernel: RowsKernel, dtype: mx.Dtype, seed: int = 0
) -> str | None:
    """Check the kernel against MLX's own product once per distinct shape of `found`, at
    `kernel.min_rows`, `kernel.max_rows` and `rows_limit` rows (which also builds the kernels
    a generation will run). Returns None when it agrees everywhere, else what failed."""
    return _first_failure([[layer] for layer in found], kernel, dtype, seed, grouped=False)


def probe_groups(
    grouped: list[list[nn.Module]], kernel: RowsKernel, dtype: mx.Dtype, seed: int = 0
) -> str | None:
    """Check `kernel.grouped` against MLX's own products once per distinct group shape, at
    `kernel.min_rows`, `kernel.max_rows` and `rows_limit` rows. None when it agrees, else what
    failed."""
    return _first_failure(grouped, kernel, dtype, seed, grouped=True)


def _first_failure(
    cases: list[list[nn.Module]], kernel: RowsKernel, dtype: mx.Dtype, seed: int, grouped: bool
) -> str | None:
    """What failed first of `cases` (each the layers one call computes: one layer, or a
    group's members through `kernel.grouped`), each distinct shape run once at
    `kernel.min_rows`, `kernel.max_rows` and `rows_limit` rows of one random input against
    MLX's own products; None when every output is within PROBE_TOLERANCE of MLX's."""
    limit = PROBE_TOLERANCE.get(dtype, 2e-2)
    seen = set()
    for members in cases:
        first = members[0]
        key = (tuple(m.weight.shape for m in members), first.bits, first.group_size)
        if key in seen:
            continue
        seen.add(key)
        weights = [(m.weight, m.scales, m.biases) for m in members]
        top = rows_limit(kernel, members, dtype)
        x = mx.random.normal((top, width(first)), key=mx.random.key(seed)).astype(dtype)
        for rows in sorted({kernel.min_rows, kernel.max_rows, top}):
            try:
                if grouped:
                    got = kernel.grouped(x[:rows], weights, first.group_size, first.bits)
                else:
                    got = [kernel(x[:rows], *weights[0], first.group_size, first.bits)]
                apart = max(
                    _apart(y, x[:rows], *triple, first.group_size, first.bits)
                    for y, triple in zip(got, weights, strict=True)
                )
            except Exception as e:  # a kernel that does not build or launch here
                who = f"{kernel.name} grouped" if grouped else kernel.name
                return f"{who}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if not apart <= limit:
                what = "grouped " if grouped else ""
                shape = "" if grouped else f" {key[0][0][0]}x{width(first)}"
                return (
                    f"{kernel.name}: {rows} rows of a {what}{first.bits}-bit{shape} product part "
                    f"from MLX's by {apart:.2e} of its largest value (limit {limit:.0e})"
                )
    return None


def _apart(got: mx.array, x: mx.array, w, scales, biases, group_size: int, bits: int) -> float:
    """How far `got` parts from MLX's own product of x and the quantized w, relative to that
    product's largest value."""
    want = mx.quantized_matmul(x, w, scales, biases, True, group_size, bits).astype(mx.float32)
    apart = mx.abs(got.astype(mx.float32) - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)
    return apart.item()


def groups(
    found: list[tuple[str, nn.Module]], kernel: RowsKernel, dtype: mx.Dtype
) -> list[list[str]]:
    """The names in `found` that form `GROUPS` (siblings of one module, all found, of one
    shape the kernel's `grouped` takes), each group in its call order."""
    if not callable(getattr(kernel, "grouped", None)):
        return []
    layer_of = dict(found)
    out = []
    parents = {n.rsplit(".", 1)[0] for n in layer_of if "." in n}
    for parent in sorted(parents):
        for names in GROUPS:
            full = [f"{parent}.{name}" for name in names]
            if not all(n in layer_of for n in full):
                continue
            shapes = {(width(layer_of[n]), layer_of[n].bits, layer_of[n].group_size) for n in full}
            if len(shapes) == 1 and kernel.groups(*shapes.pop(), dtype):
                out.append(full)
    return out


def install(
    model: nn.Module,
    kernel: RowsKernel,
    dtype: mx.Dtype,
    found: list[tuple[str, nn.Module]] | None = None,
    group: bool = True,
) -> tuple[int, str | None]:
    """Put `QuantizedRows` in front of every layer of `model` the kernel takes (`found`, when
    the caller has looked them up already), after `probe` passed on them, in place of any
    kernel installed before, and, with `group`,
    join sibling layers that read one input into `RowsGroup`s where `probe_groups` passed.
    Returns (layers wrapped, what failed: why none were wrapped, or why none were grouped;
    None when nothing failed)."""
    from mlx.utils import tree_unflatten

    if uninstall(model):  # one kernel a layer: a second install replaces the first
        found = None
    found = layers(model, kernel, dtype) if found is None else found
    if not found:
        return 0, None
    failed = probe((m for _, m in found), kernel, dtype)
    if failed:
        return 0, failed
    queue = DenseQueue()
    wrappers = {
        n: QuantizedRows(
            m, kernel, dense_from(kernel, m, dtype), queue, rows_limit(kernel, [m], dtype)
        )
        for n, m in found
    }
    named = groups(found, kernel, dtype) if group else []
    failed = probe_groups([[wrappers[n].linear for n in names] for names in named], kernel, dtype)
    for names in [] if failed else named:
        members = [wrappers[n].linear for n in names]
        joined = RowsGroup(kernel, members)
        top = rows_limit(kernel, members, dtype)  # one launch computes them all
        for i, n in enumerate(names):
            wrappers[n]._group, wrappers[n]._index = joined, i
            wrappers[n].max_rows = min(wrappers[n].max_rows, top)
    model.update_modules(tree_unflatten(list(wrappers.items())))
    return len(found), failed and f"{failed}; each layer runs alone"


def uninstall(model: nn.Module) -> int:
    """Take every `QuantizedRows` out of `model`; returns how many."""
    from mlx.utils import tree_unflatten

    swaps = [(n, m.linear) for n, m in model.named_modules() if isinstance(m, QuantizedRows)]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def installed(model: nn.Module) -> bool:
    """Whether some layer of `model` runs a rows kernel."""
    return any(isinstance(m, QuantizedRows) for _, m in model.named_modules())


def dense_rows(model: nn.Module) -> int | None:
    """From how many rows every layer of `model` that can run its products dequantized does
    (the largest `dense_from`); None where none can. A prefill chunk shorter than this runs
    some products the slow way (`Target.prefill` keeps its chunks at least this long)."""
    rows = [
        m.dense_from
        for _, m in model.named_modules()
        if isinstance(m, QuantizedRows) and m.dense_from is not None
    ]
    return max(rows, default=None)


def apply(model: nn.Module, kernels: Iterable[RowsKernel], choice: str) -> str | None:
    """At load: put the first available kernel in front of `model`'s quantized layers, sibling
    layers grouped where the kernel can, where `choice` (OUTRIDER_MATMUL) is `rows`, or where
    it is `auto` and the kernel is `preferred` for every such layer; `native` keeps MLX's
    products. Returns a line for the load's notes when the kernel was asked for and could not
    be used."""
    from .device import compute_dtype

    if choice not in ("rows", "auto"):
        return None
    kernel = next((k for k in kernels if k.available()), None)
    if kernel is None:
        if choice == "rows":
            return (
                "OUTRIDER_MATMUL=rows: no rows kernel runs on this device; MLX's products are used"
            )
        return None
    dtype = compute_dtype(model) or mx.float32
    found = layers(model, kernel, dtype)
    if choice == "auto":
        shapes = {(width(m), m.bits, m.group_size) for _, m in found}
        if not shapes or not all(kernel.preferred(*shape, dtype) for shape in shapes):
            return None
    wrapped, failed = install(model, kernel, dtype, found)
    if failed and not wrapped:
        return f"OUTRIDER_MATMUL={choice}: {failed}; MLX's products are used"
    return failed and f"OUTRIDER_MATMUL={choice}: {failed}"
