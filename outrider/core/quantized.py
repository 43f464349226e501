"""Drafter checkpoints stored quantised, the way mlx-lm stores models.

A quantised tensor `X.weight` (packed uint32) travels with `X.scales` and `X.biases`, and
config.json says {"quantization": {"group_size": G, "bits": N}}. Drafter loaders build float
networks and check shapes strictly, so `dequantize_tensors` turns such a checkpoint back into
float tensors on reading; the strategy then quantises again at its own --drafter-bits. This
lets a small drafter ship at a quarter of its float size (the embedded demo pair does).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .errors import CheckpointError
from .modelopt import dequantize_modelopt, is_modelopt


def quantizable(name: str, array: mx.array, group_size: int) -> bool:
    """The tensors mlx-lm would quantise: 2-D weights whose rows split into whole groups."""
    return (
        name.endswith(".weight")
        and array.ndim == 2
        and array.shape[0] > 1
        and array.shape[-1] % group_size == 0
        and mx.issubdtype(array.dtype, mx.floating)
    )


def quantize_tensors(
    tensors: dict[str, mx.array], group_size: int = 64, bits: int = 4
) -> dict[str, mx.array]:
    """Quantise every quantisable weight (affine, mlx-lm layout); other tensors pass through."""
    out: dict[str, mx.array] = {}
    for name, array in tensors.items():
        if quantizable(name, array, group_size):
            stem = name[: -len(".weight")]
            w, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
            out[name], out[f"{stem}.scales"], out[f"{stem}.biases"] = w, scales, biases
        else:
            out[name] = array
    return out


def dequantize_tensors(tensors: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Float tensors back from a quantised checkpoint, mlx-lm's packing or NVIDIA modelopt's
    NVFP4 (`core/modelopt.py`); a float one is returned as is."""
    if is_modelopt(tensors):
        return dequantize_modelopt(tensors, config)
    stems = [n[: -len(".scales")] for n in tensors if n.endswith(".scales")]
    if not stems:
        return tensors
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict) or "bits" not in quant or "group_size" not in quant:
        raise CheckpointError(
            "checkpoint has quantised tensors (.scales) but config.json has no "
            "quantization {group_size, bits}"
        )
    if quant.get("mode", "affine") != "affine":
        raise CheckpointError(f"quantization mode {quant['mode']!r} is not supported for drafters")
    out = dict(tensors)
    for stem in stems:
        weight, biases = out.get(f"{stem}.weight"), out.get(f"{stem}.biases")
        if weight is None or biases is None:
            raise CheckpointError(f"quantised tensor {stem} lacks its .weight or .biases")
        out[f"{stem}.weight"] = mx.dequantize(
            weight,
            out.pop(f"{stem}.scales"),
            out.pop(f"{stem}.biases"),
            group_size=int(quant["group_size"]),
            bits=int(quant["bits"]),
        )
    return out


def quantize_checkpoint(folder: Path, bits: int = 4, group_size: int = 64) -> None:
    """Rewrite a float drafter checkpoint in place, quantised, with its config saying how."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors weight files")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("quantization"):
        raise CheckpointError(f"{folder} is quantised already")
    tensors: dict[str, mx.array] = {}
    for f in files:
        tensors.update(mx.load(str(f)))
    packed = quantize_tensors(tensors, group_size, bits)  # scales keep the weights' dtype
    mx.eval(packed)
    for f in files:
        f.unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), packed)
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    config_path.write_text(json.dumps(config, indent=2))
