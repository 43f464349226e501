"""Random-weight DSpark drafters in SpecForge's packaging (sgl-project/SpecForge
`configs/qwen3-4b-dspark.json`, `specforge/modeling/draft/dspark.py`): `DSparkDraftModel`, a flat
Qwen3 config with the drafter's fields under `dflash_config`, bf16 backbone and head tensors
without an embedding or LM head (the target's are used), every block slot drafting."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .drafters import PT, random_block_drafter, save_checkpoint


def write_specforge_dspark(path: Path, target: Path, kind: str, seed: int = 1, **overrides) -> Path:
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=0, own_embedding=False, own_lm_head=False,
        format="specforge-dspark", **overrides,
    )  # fmt: skip
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    dflash_config = {
        "attention_mode": "gqa",
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
        "projector_type": "dspark",
        "markov_rank": spec.markov_rank,
        "markov_head_type": spec.markov_type,
        "confidence_head_alpha": 1.0 if spec.confidence_head else 0.0,
        "enable_confidence_head": spec.confidence_head,
        "confidence_head_with_markov": spec.confidence_with_markov,
    }
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "attention_bias": False,
        "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},  # present on the hub; never run
        "block_size": spec.block_size,
        "dflash_config": dflash_config,
        "dtype": "bfloat16",
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "layer_types": ["full_attention"] * spec.num_layers,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "model_type": "qwen3",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": spec.vocab_size,
    }
    return save_checkpoint(path, weights, cfg, PT)
