"""Random-weight DSpark drafters in NVIDIA's packaging (its Nemotron-3.5-Lightning DSpark head):
DeepSpec's `Qwen3DSparkModel` layout with the DFlash lineage's block attention, quantised by
NVIDIA Model Optimizer to NVFP4.

The config follows the published head's (block 8 with the bonus token as anchor:
`dspark_bonus_anchor: true`, `sample_from_anchor: false`; a `dflash_config` with `causal`,
`use_swa` / `swa_window_size`, `attention_sink_bias`, the mask id and the taps;
`eagle_aux_hidden_state_layer_ids` one above the taps; no `enable_confidence_head`;
`quantization_config.quant_algo` "W4A16_NVFP4"). The tensors carry an embedding, no output head
(the target's), a per-head `attention_sink_bias` a layer, and the MLP, `fc` and `markov_w2`
linears in modelopt's NVFP4 packing with their block scales typed F8_E4M3 in the safetensors
header, as modelopt writes them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from .drafters import PT, block_spec, random_block_weights, save_checkpoint, target_text_config

QUANTISED = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "fc", "markov_head.markov_w2")
QUANTISED_WEIGHTS = tuple(f"{q}.weight" for q in QUANTISED)
FP8_MAX, FP4_MAX = 448.0, 6.0


def write_nvidia_dspark(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    window: int = 16,
    causal: bool = True,
    sinks: bool = True,
    nvfp4: bool = True,
    dtype: str = "bfloat16",
    **overrides,
) -> Path:
    """`window` None: no sliding window (`use_swa: false`); `nvfp4=False`: float tensors
    (as a bf16 conversion of the head ships them); `dtype` the float tensors' type."""
    tcfg = target_text_config(target)
    spec = block_spec(
        tcfg, kind, logits_start=1, own_embedding=True, own_lm_head=False, format="deepspec",
        **overrides,
    )  # fmt: skip
    spec.causal_block, spec.attention_sinks = causal, sinks
    if window is not None:
        spec.sliding_window = window
        spec.layer_types = ("sliding_attention",) * spec.num_layers
    weights = random_block_weights(spec, seed)
    for name in [n for n in weights if n.endswith("attention_sink_bias")]:
        weights[name] = mx.random.normal(weights[name].shape)  # sinks that take a share
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    fp8 = []
    if nvfp4:
        for stem in [n[: -len(".weight")] for n in weights if n.endswith(QUANTISED_WEIGHTS)]:
            codes, scales, scale2 = nvfp4_pack(weights.pop(f"{stem}.weight"))
            weights[f"{stem}.weight"] = codes
            weights[f"{stem}.weight_scale"] = scales
            weights[f"{stem}.weight_scale_2"] = scale2
            fp8.append(f"{stem}.weight_scale")
    taps = list(spec.target_layer_ids)
    nested = {
        "attention_sink_bias": sinks,
        "causal": causal,
        "mask_token_id": spec.mask_token_id,
        "swa_window_size": window or 1024,
        "target_layer_ids": taps,
        "use_swa": window is not None,
        "sample_from_anchor": False,
    }
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "attention_sink_bias": sinks,
        "block_size": spec.block_size,
        "dflash_config": nested,
        "dspark_bonus_anchor": True,
        "dspark_markov_rank": spec.markov_rank,
        "markov_rank": spec.markov_rank,
        "target_layer_ids": taps,
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "sample_from_anchor": False,
    }
    if nvfp4:
        cfg["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "W4A16_NVFP4",
            "kv_cache_quant_algo": None,
        }
    save_checkpoint(path, weights, cfg, PT)
    retype(path / "model.safetensors", fp8, "F8_E4M3")
    if nvfp4:  # modelopt's own record of the same; outrider reads config.json
        record = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}
        (path / "hf_quant_config.json").write_text(json.dumps(record, indent=2))
    return path


def nvfp4_pack(w: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """modelopt's NVFP4 packing of a float weight [out, in]: (codes uint8 [out, in / 2],
    block scales as FP8 bytes [out, in / 16], the per-tensor float32 scale)."""
    w = w.astype(mx.float32)
    scale2 = mx.max(mx.abs(w)) / (FP8_MAX * FP4_MAX)
    codes, scales = mx.quantize(w / scale2, group_size=16, bits=4, mode="nvfp4")
    return codes.view(mx.uint8), scales, scale2.astype(mx.float32)


def retype(path: Path, names: list[str], dtype: str) -> None:
    """Rewrite the safetensors header so `names` (one-byte tensors) read as `dtype`, as
    PyTorch writes float8 tensors; the data is left as it is."""
    if not names:
        return
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    for name in names:
        header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])
