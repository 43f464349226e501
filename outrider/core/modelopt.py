"""Drafter checkpoints quantised by NVIDIA Model Optimizer (modelopt) to NVFP4.

NVIDIA ships its Nemotron DSpark head this way (`quantization_config.quant_algo`
"W4A16_NVFP4"): each quantised linear `X` is stored as

- `X.weight`: uint8 [out, in / 2], two FP4 (E2M1) codes a byte, the lower nibble first;
- `X.weight_scale`: FP8 (E4M3) [out, in / 16], one scale per 16 inputs (safetensors dtype
  F8_E4M3, which MLX reads as uint8);
- `X.weight_scale_2`: float32, one scale for the whole tensor;

and w = E2M1(code) * E4M3(weight_scale) * weight_scale_2. Other tensors (attention, embedding,
norms, sinks) stay in their float type. That block layout is MLX's own `nvfp4` mode, so the
codes reinterpreted as uint32 decode with `mx.dequantize`; the per-tensor scale multiplies
after. The decode is exact (float32) and then cast to the checkpoint's float type.

Activation and KV-cache scales (`input_scale`, `k_scale`, `v_scale`, present when activations
were quantised too) are dropped: a drafter runs its activations in float, which changes only
how well it drafts, never what the target commits.
"""

from __future__ import annotations

import mlx.core as mx

from .errors import CheckpointError

GROUP = 16  # inputs a block scale covers
DROPPED = (".input_scale", ".k_scale", ".v_scale")


def is_modelopt(tensors: dict[str, mx.array]) -> bool:
    """True when the tensors are modelopt's packing (a `.weight_scale_2` anywhere)."""
    return any(name.endswith(".weight_scale_2") for name in tensors)


def algorithm(config: dict) -> str:
    """The quantisation algorithm config.json names ("" when it names none)."""
    quant = config.get("quantization_config") or config.get("quantization") or {}
    if not isinstance(quant, dict):
        return ""
    return str(quant.get("quant_algo") or "")


def dequantize_modelopt(tensors: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Float tensors from a modelopt NVFP4 checkpoint; another modelopt algorithm, or a
    tensor whose packing does not match NVFP4's, is refused by name."""
    algo = algorithm(config)
    if algo and ("NVFP4" not in algo.upper() or "AWQ" in algo.upper()):
        raise CheckpointError(
            f"drafter checkpoint is quantised with modelopt {algo}; outrider reads modelopt "
            "checkpoints in NVFP4 only"
        )
    stems = [n[: -len(".weight_scale_2")] for n in tensors if n.endswith(".weight_scale_2")]
    dtype = _float_type(tensors)
    out = {n: a for n, a in tensors.items() if not n.endswith(DROPPED)}
    for stem in stems:
        out[f"{stem}.weight"] = _decode(
            stem,
            out.get(f"{stem}.weight"),
            out.pop(f"{stem}.weight_scale", None),
            out.pop(f"{stem}.weight_scale_2"),
        ).astype(dtype)
    stray = next((n for n in out if n.endswith(".weight_scale")), None)
    if stray is not None:
        raise CheckpointError(f"modelopt tensor {stray} has no {stray}_2 (per-tensor scale)")
    return out


def _decode(stem: str, codes, scales, scale2: mx.array) -> mx.array:
    if codes is None or scales is None:
        raise CheckpointError(f"modelopt tensor {stem} lacks its .weight or .weight_scale")
    if codes.dtype != mx.uint8 or codes.ndim != 2 or scales.dtype != mx.uint8:
        raise CheckpointError(
            f"modelopt tensor {stem} is not NVFP4-packed (.weight {codes.dtype} "
            f"{tuple(codes.shape)}, .weight_scale {scales.dtype})"
        )
    rows, inputs = codes.shape[0], codes.shape[1] * 2
    if inputs % GROUP or tuple(scales.shape) != (rows, inputs // GROUP):
        raise CheckpointError(
            f"modelopt tensor {stem}.weight_scale has shape {tuple(scales.shape)}, expected "
            f"{(rows, inputs // GROUP)} for a {rows}x{inputs} NVFP4 weight"
        )
    if scale2.size != 1:
        raise CheckpointError(f"modelopt tensor {stem}.weight_scale_2 must hold one number")
    w = mx.dequantize(
        codes.view(mx.uint32), scales, group_size=GROUP, bits=4, mode="nvfp4", dtype=mx.float32
    )
    return w * scale2.astype(mx.float32).reshape(())


def _float_type(tensors: dict[str, mx.array]) -> mx.Dtype:
    """The float type the checkpoint keeps its unquantised tensors in (bfloat16 if none)."""
    for name, array in tensors.items():
        if mx.issubdtype(array.dtype, mx.floating) and not name.endswith(
            (".weight_scale_2", *DROPPED)
        ):
            return array.dtype
    return mx.bfloat16
