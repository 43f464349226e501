"""Random-weight DSpark drafters in LiquidAI's packaging (the LiquidAI/LFM2.5-*-DSpark repos,
as vLLM's `Lfm2DSparkForCausalLM` and mlx-vlm's tests read them): `Lfm2DSparkDraftModel`, a
Qwen3 config with the drafter's ids under a `dflash_config` without `projector_type`, the Markov
and confidence fields at the top level, interleaved rope (`rope_is_neox_style: false`), bf16
tensors and no embedding or LM head (the LFM2 target's tied embedding serves both)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .drafters import PT, random_block_drafter, save_checkpoint


def write_liquid_dspark(
    path: Path, target: Path, kind: str, seed: int = 1, neox: bool = False, **overrides
) -> Path:
    """`neox=True` writes `rope_is_neox_style: true` (rotate-half), as a checkpoint may."""
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=0, own_embedding=False, own_lm_head=False,
        format="liquid-dspark", **overrides,
    )  # fmt: skip
    weights = {f"model.{k}": v.astype(mx.bfloat16) for k, v in weights.items()}
    cfg = {
        "architectures": ["Lfm2DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": spec.vocab_size,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "layer_types": ["full_attention"] * spec.num_layers,
        "block_size": spec.block_size,
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
            "num_target_layers": tcfg["num_hidden_layers"],
        },
        "markov_rank": spec.markov_rank,
        "rope_is_neox_style": neox,
        "enable_confidence_head": spec.confidence_head,
        "markov_head_type": spec.markov_type,
    }
    return save_checkpoint(path, weights, cfg, PT)
