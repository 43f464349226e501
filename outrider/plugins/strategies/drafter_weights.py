"""Loading a checkpoint's weights into a drafter network, the same strict way for every kind.

Every parameter the network's config implies must be there with its shape, and nothing else may
be: a mismatch means the config and the tensors disagree (a damaged or mislabelled checkpoint),
and loading it would draft garbage silently. Quantising afterwards is the user's `--drafter-bits`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...core.device import (
    dense_on_cpu,
    dense_single_groups,
    make_dense,
    on_cuda_gpu,
    one_group_wide,
)
from ...core.errors import CheckpointError


def _first(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def load_strict(model: nn.Module, weights: dict[str, mx.array], what: str, kind: str = "") -> None:
    """Load `weights` into `model`, refusing a missing, unexpected or misshapen tensor in one
    line (`what` names the checkpoint, e.g. "drafter"; `kind` says what it was read as)."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise CheckpointError(f"{what} checkpoint is missing tensor {_first(missing)}")
    if unexpected:
        raise CheckpointError(
            f"{what} checkpoint has unexpected tensor {_first(unexpected)}"
            + (f" for {kind}" if kind else "")
        )
    for name, arr in expected.items():
        if tuple(weights[name].shape) != tuple(arr.shape):
            raise CheckpointError(
                f"{what} tensor {name} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(arr.shape)} from its config"
            )
    model.load_weights(list(weights.items()), strict=True)


def quantize(
    model: nn.Module,
    bits: int,
    group_size: int = 64,
    keep: Callable[[str, nn.Module], bool] = lambda path, module: False,
) -> None:
    """Quantise the linear and embedding layers MLX can (width divisible by the group, more
    than one row) to `bits` (16: leave as stored), except where `keep(path, module)`, and on a
    CUDA GPU layers one group wide, whose products MLX 0.32 computes wrongly there.

    On a CPU with an optimized BLAS the quantized values then run dequantized in float32
    (`core/device.py`'s `dense_on_cpu`), as the target's do: MLX's CPU quantized matmul costs
    a drafter's block of rows row by row."""
    if bits not in (4, 8, 16):
        raise ValueError(f"drafter bits must be 16, 8 or 4, got {bits}")
    if bits < 16:
        cuda = on_cuda_gpu()  # layers one group wide stay as they are there (core/device.py)
        nn.quantize(
            model,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda path, m: (
                isinstance(m, (nn.Linear, nn.Embedding))
                and m.weight.shape[-1] % group_size == 0
                and m.weight.shape[0] > 1
                and not (cuda and one_group_wide(m.weight.shape[-1], bits, group_size))
                and not keep(path, m)
            ),
        )
        if dense_on_cpu(model):
            make_dense(model)
        dense_single_groups(model)  # an MLX CUDA kernel's wrong case (core/device.py)
    mx.eval(model.parameters())
