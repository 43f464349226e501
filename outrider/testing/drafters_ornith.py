"""Random-weight DSpark drafters of the qwen3_5-native fork (Ornith's
stanleyphoong/Ornith-1.0-9B-DSpark shape, as mlx-dspark's tests condense it): DeepSpec's layout
under `Qwen35DSparkModel` with `model_type "qwen3_5"`, `enable_qwen35_gated_q_proj` (q_proj twice
as wide: [q ‖ gate] per head), a `partial_rotary_factor` of 0.25, RMSNorm weights stored as
offsets from one, per-slot `confidence_temperatures`, and the target's config copied in around
it (mrope sections, a `text_config`, a `vision_config`)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .drafters import (
    block_spec,
    deepspec_config,
    random_block_weights,
    save_checkpoint,
    target_embedding_and_head,
    target_text_config,
)

PARTIAL_ROTARY = 0.25


def write_ornith_dspark(path: Path, target: Path, kind: str, seed: int = 1, **overrides) -> Path:
    tcfg = target_text_config(target)
    spec = block_spec(
        tcfg, kind, logits_start=0, own_embedding=True, own_lm_head=True, format="deepspec",
        block_size=overrides.pop("block_size", 7), **overrides,
    )  # fmt: skip
    spec.gated_q = True
    spec.rope_dims = int(spec.head_dim * PARTIAL_ROTARY)
    weights = random_block_weights(spec, seed)
    weights["embed_tokens.weight"], weights["lm_head.weight"] = target_embedding_and_head(target)
    mx.random.seed(seed + 1)
    for name in [n for n in weights if n.endswith("norm.weight")]:
        norm = 1 + 0.2 * mx.random.normal(weights[name].shape)  # the weight each norm applies
        weights[name] = norm - 1  # stored as its offset from one, Qwen3.5's way
    cfg = deepspec_config(tcfg, spec, architecture="Qwen35DSparkModel")
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    cfg.update(
        model_type="qwen3_5",
        enable_qwen35_gated_q_proj=True,
        partial_rotary_factor=PARTIAL_ROTARY,
        rope_parameters={
            **rope,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        confidence_temperatures=[1.5, 0.9, 1.5, 1.6, 0.9, 1.4, 1.6][: spec.block_size],
        text_config={"model_type": "qwen3_5_text"},
        vision_config={"depth": 27},
    )
    return save_checkpoint(path, weights, cfg)
