"""DeepSpec's `Gemma4DSparkModel` drafters for tiny Gemma-4 targets, laid out as DeepSpec saves
them (deepseek-ai/DeepSpec `deepspec/modeling/dspark/gemma4/config.py`, `.../modeling.py`,
`deepspec/trainer/ckpt_manager.py`).

config.json is the target's Gemma-4 text config as transformers serialises it (the fields
`build_draft_config` requires, defaults filled in; `rope_parameters` keyed by layer type, with a
target's stray top-level `rope_theta` carried in beside them) plus the drafter's fields;
`architectures: ["Gemma4DSparkModel"]`, `model_type: gemma4_text`, `target_model_type: gemma4`.
Tensors are bfloat16 under the module names, no prefix: v_proj only without
`attention_k_eq_v`, no v_norm weight, a `layer_scalar` buffer of ones per layer, and frozen
copies of the target's embedding and output head.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core.drafter_spec import DrafterSpec
from ..plugins.formats.deepspec_gemma4 import gemma4_backbone_fields
from .drafters import (
    PT,
    block_spec,
    deepspec_config,
    save_checkpoint,
    target_embedding_and_head,
)

GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")

# Gemma4TextConfig defaults (transformers 5.x) for the fields DeepSpec requires of a target.
TEXT_DEFAULTS = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size_per_layer_input": 256,
    "initializer_range": 0.02,
    "num_global_key_value_heads": None,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "final_logit_softcapping": None,
}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


def is_gemma4_target(target: Path) -> bool:
    cfg = json.loads((Path(target) / "config.json").read_text())
    return cfg.get("model_type") in GEMMA4_MODEL_TYPES


def gemma4_text_config(target: Path) -> dict:
    """The target's text config as DeepSpec's copy of it serialises (`get_gemma4_text_config`
    takes `text_config` alone from a multimodal checkpoint)."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    text = copy.deepcopy(cfg.get("text_config") or cfg)
    for key in ("quantization", "quantization_config", "architectures"):
        text.pop(key, None)
    tcfg = {**TEXT_DEFAULTS, **text}
    rope = tcfg.get("rope_parameters") or {k: dict(v) for k, v in DEFAULT_ROPE.items()}
    if "rope_theta" in tcfg:
        rope = {**rope, "rope_theta": tcfg.pop("rope_theta")}
    tcfg["rope_parameters"] = rope
    tcfg.pop("torch_dtype", None)
    tcfg["dtype"] = "bfloat16"
    return tcfg


def gemma4_spec(tcfg: dict, kind: str, **overrides) -> DrafterSpec:
    """The canonical spec of a random Gemma-4 block drafter for a Gemma-4 text config."""
    base = block_spec(
        tcfg,
        kind,
        logits_start=0,
        own_embedding=True,
        own_lm_head=True,
        format="deepspec",
        **overrides,
    )
    fields = gemma4_backbone_fields({**tcfg, "num_hidden_layers": base.num_layers})
    return dataclasses.replace(base, **fields)


def random_gemma4_weights(spec: DrafterSpec, seed: int = 1) -> dict[str, mx.array]:
    """Random weights under DeepSpec's Gemma-4 names (norm weights random too, so a wrong norm
    convention shows; layer_scalar stays the untrained buffer of ones)."""
    from ..plugins.strategies.gemma4_block_drafter import Gemma4BlockDrafter

    mx.random.seed(seed)
    weights = dict(tree_flatten(Gemma4BlockDrafter(spec).parameters()))
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.3 * mx.random.normal(w.shape)
    return weights


def write_deepspec_gemma4(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    attention_k_eq_v: bool = False,
    num_global_key_value_heads: int | None = None,
    **overrides,
) -> Path:
    """DeepSpec's Gemma4DSparkModel (DSpark, or DFlash with the heads off) for a Gemma-4 target.

    `attention_k_eq_v` / `num_global_key_value_heads` set those text-config fields, as the
    Gemma-4 checkpoints that share K and V in their global layers declare them.
    """
    tcfg = gemma4_text_config(target)
    if attention_k_eq_v:
        tcfg["attention_k_eq_v"] = True
        tcfg["num_global_key_value_heads"] = num_global_key_value_heads or 1
    spec = gemma4_spec(tcfg, kind, **overrides)
    weights = random_gemma4_weights(spec, seed)
    weights["embed_tokens.weight"], weights["lm_head.weight"] = target_embedding_and_head(target)
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    cfg = deepspec_config(tcfg, spec, "Gemma4DSparkModel")
    cfg.update(
        model_type="gemma4_text",
        head_dim=tcfg["head_dim"],  # the sliding layers' size; the drafter uses global_head_dim
        target_model_type="gemma4",
        target_text_model_type="gemma4_text",
    )
    return save_checkpoint(path, weights, cfg, PT)
