"""Random-weight DFlash 2 drafters laid out like the published ones.

Layout of z-lab/dflash `tests/fixtures/dflash2-config.json` and
`tests/fixtures/dflash2-safetensors-header.json`: fields under `dflash_config` (block_size,
conv_*, selector_*, output_multiplier, final_logit_softcapping, mask_token_id,
target_layer_ids), `is_causal: false`, every layer `sliding_attention`, `rope_parameters`; BF16
tensors, per layer `{attention,mlp}_conv.base_kernel` [2, K, H] and
`{attention,mlp}_conv.kernel_projection.weight` [2 K H / G, H], the selector's codebooks stored
without `.weight`; no embedding, no head.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core.drafter_spec import DrafterSpec
from .drafters import PT, block_spec, save_checkpoint, target_text_config


def dflash2_spec(
    tcfg: dict,
    *,
    num_layers: int = 2,
    block_size: int = 9,
    target_layer_ids: list[int] | None = None,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 16,
    selector_top_k: int = 16,
    output_multiplier: float = 0.5,
    final_logit_softcapping: float | None = 20.0,
    sliding_window: int = 16,
    layer_type: str = "sliding_attention",
    is_causal: bool | None = False,
) -> DrafterSpec:
    """The canonical spec of a random DFlash 2 drafter for a target config."""
    spec = block_spec(
        tcfg,
        "dflash2",
        logits_start=1,
        own_embedding=False,
        own_lm_head=False,
        format="dflash2",
        num_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids,
    )
    spec.layer_types = (layer_type,) * num_layers
    spec.sliding_window = sliding_window if layer_type == "sliding_attention" else None
    spec.conv_kernel_size, spec.conv_group_size = conv_kernel_size, conv_group_size
    spec.selector_rank, spec.selector_top_k = selector_rank, selector_top_k
    spec.output_multiplier = output_multiplier
    spec.final_logit_softcapping = final_logit_softcapping
    spec.extra = {"input_embedding_scale": 1.0, "is_causal": is_causal}
    return spec


def random_dflash2_weights(spec: DrafterSpec, seed: int = 1) -> dict[str, mx.array]:
    """Random weights under the published names, scaled so the convs and the selector's
    lattice move the drafts (identity-like base kernels, codebooks of unit-order entries)."""
    from ..plugins.strategies.dflash2_drafter import DFlash2Drafter

    mx.random.seed(seed)
    weights = dict(tree_flatten(DFlash2Drafter(spec).parameters()))
    k, h = spec.conv_kernel_size, spec.hidden_size
    for name in list(weights):
        shape = weights[name].shape
        if name.endswith("base_kernel"):
            identity = mx.zeros((2, k, h)).at[:, 0, :].add(1.0)
            weights[name] = identity + 0.3 * mx.random.normal(shape)
        elif name.endswith("kernel_projection.weight"):
            weights[name] = 0.1 * mx.random.normal(shape)
        elif name.endswith("_codebook"):
            weights[name] = mx.random.normal(shape)
        elif name == "candidate_selector.hidden_projection.weight":
            weights[name] = mx.random.normal(shape) / h**0.5
    return {name: w.astype(mx.bfloat16) for name, w in weights.items()}


def dflash2_config(tcfg: dict, spec: DrafterSpec) -> dict:
    """config.json with the published fixture's keys."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "is_causal": spec.extra.get("is_causal"),
        "dflash_config": {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": spec.conv_kernel_size,
            "final_logit_softcapping": spec.final_logit_softcapping,
            "mask_token_id": spec.mask_token_id,
            "output_multiplier": spec.output_multiplier,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        "dtype": "bfloat16",
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "layer_types": list(spec.layer_types),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "model_type": "qwen3",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "sliding_window": spec.sliding_window,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": spec.sliding_window is not None,
        "vocab_size": spec.vocab_size,
    }


def write_dflash2(path: Path, target: Path, kind: str, seed: int = 1, **overrides) -> Path:
    """DFlash 2 (Inco AI) as published: dflash_config with conv and selector fields, BF16."""
    tcfg = target_text_config(target)
    spec = dflash2_spec(tcfg, **overrides)
    cfg = dflash2_config(tcfg, spec)
    if cfg["is_causal"] is None:
        del cfg["is_causal"]
    return save_checkpoint(path, random_dflash2_weights(spec, seed), cfg, PT)
