"""Hidden-state taps on one model instance: what a drafter reads of the target.

Taps wrap entries of the instance's own layer list (never the model classes), so the model's
forward runs unchanged and its logits are bit-identical to plain decoding; the wrappers only
record the raw output of the tapped decoder layers (DeepSpec convention: id j = output of
layer j, id -1 = the embedding output, i.e. the input of layer 0).

A looped-depth model runs its layer list several times a forward (a family's `loops`); its
tap ids index the unrolled stream, id j + k·n being layer j's output in loop k, and where the
model norms the stream between loops (the family's `loop_boundary`), the last layer's tap in
every loop but the last is taken after that norm: the state the next loop starts from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .wrapper import PassThrough


class TapSink:
    """What the tapped layers of one forward recorded, while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.store: dict[int, mx.array] = {}
        self.calls: dict[int, int] = {}  # per tapped layer: its calls so far in this forward

    def clear(self) -> None:
        self.store = {}
        self.calls = {}


class TappedLayer(PassThrough):
    """Pass-through wrapper around one decoder layer of one model instance."""

    wrapped = "layer"

    def __init__(
        self,
        layer: nn.Module,
        sink: TapSink,
        index: int,
        capture_input: bool,
        stride: int = 0,
        boundary: tuple[int, Callable[[mx.array], mx.array]] | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self._sink = sink
        self._index = index
        self._capture_input = capture_input
        self._capture_output = False
        self._stride = stride  # a looped model: call k of this layer is tap index + k·stride
        self._boundary = boundary  # (loops, the norm between loops), on a loop's last layer

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(x, *args, **kwargs)
        sink = self._sink
        if sink.active:
            k = sink.calls.get(self._index, 0)
            sink.calls[self._index] = k + 1
            if self._capture_input and k == 0:
                sink.store[-1] = x
            if self._capture_output:
                h = out[0] if isinstance(out, tuple) else out
                if self._boundary is not None and k < self._boundary[0] - 1:
                    h = self._boundary[1](h)
                sink.store[self._index + k * self._stride] = h
        return out


def wrap(
    layers: list,
    sink: TapSink,
    layer_ids: Iterable[int],
    loops: int = 1,
    boundary: Callable[[mx.array], mx.array] | None = None,
) -> None:
    """Wrap the entries of `layers` (the model's own list, changed in place) that `layer_ids`
    read, each once (a second call adds captures to the wrappers already there). `loops` and
    `boundary` describe a looped-depth model (see above)."""
    n = len(layers)
    for j in sorted(layer_ids):
        idx = 0 if j == -1 else j % n
        wrapper = layers[idx]
        if not isinstance(wrapper, TappedLayer):
            edge = (loops, boundary) if boundary is not None and idx == n - 1 else None
            wrapper = TappedLayer(wrapper, sink, idx, False, n, edge)
            layers[idx] = wrapper
        if j == -1:
            wrapper._capture_input = True
        else:
            wrapper._capture_output = True
