"""The Gemma-4 half of DeepSpec's packaging: reading a `Gemma4DSparkModel` config.

DeepSpec saves a deep copy of the target's Gemma-4 *text* config (so its fields sit at the top
level, `model_type: gemma4_text`) with the drafter's fields on top (deepseek-ai/DeepSpec
`deepspec/modeling/dspark/gemma4/config.py` `build_draft_config`). The draft layers are all
full attention: head size `global_head_dim`, KV heads `num_global_key_value_heads` when
`attention_k_eq_v` (no `v_proj`; V is the raw K projection) else `num_key_value_heads`, RoPE from
`rope_parameters["full_attention"]` (`deepspec/modeling/dspark/gemma4/modeling.py`).
"""

from __future__ import annotations

from ...core.errors import CheckpointError
from ...core.formats import as_int, require

# transformers' `gelu_pytorch_tanh` / `gelu_new` are the tanh approximation; `gelu` is exact.
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")
ROPE_TYPES = ("default", "proportional")


def is_gemma4(config: dict) -> bool:
    archs = config.get("architectures") or []
    return any(str(a).startswith("Gemma4") for a in archs)


def _flag(config: dict, key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"drafter config field {key!r} must be true or false, got {value!r}")
    return value


def _full_attention_rope(config: dict) -> dict:
    """The global layers' RoPE: Gemma-4 keys rope_parameters by layer type; a stray top-level
    `rope_theta` that transformers 5 carries in beside them is not the drafter's."""
    params = require(config, "rope_parameters")
    full = params.get("full_attention") if isinstance(params, dict) else None
    if not isinstance(full, dict) or "rope_theta" not in full:
        raise CheckpointError(
            "Gemma-4 drafter config lacks rope_parameters.full_attention.rope_theta"
        )
    rope_type = full.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"Gemma-4 drafter RoPE type {rope_type!r} is not supported")
    return dict(full)


def gemma4_backbone_fields(config: dict) -> dict:
    """DrafterSpec fields of a Gemma4DSparkModel backbone, validated (a `text_config` nesting
    is read too, though DeepSpec writes the text fields flat)."""
    cfg = {**config, **(config.get("text_config") or {})}
    if _flag(cfg, "enable_moe_block"):
        raise CheckpointError("Gemma-4 DSpark drafters with MoE blocks are not supported")
    if as_int(cfg.get("hidden_size_per_layer_input", 0) or 0, "hidden_size_per_layer_input"):
        raise CheckpointError("Gemma-4 DSpark drafters with per-layer inputs are not supported")
    hidden = as_int(require(cfg, "hidden_size"), "hidden_size")
    heads = as_int(require(cfg, "num_attention_heads"), "num_attention_heads")
    head_dim = as_int(require(cfg, "global_head_dim"), "global_head_dim")
    k_eq_v = _flag(cfg, "attention_k_eq_v")
    kv_key = "num_global_key_value_heads" if k_eq_v else "num_key_value_heads"
    if cfg.get(kv_key) is None:
        raise CheckpointError(f"Gemma-4 drafter config lacks {kv_key}")
    kv_heads = as_int(cfg[kv_key], kv_key)
    if kv_heads < 1 or heads % kv_heads:
        raise CheckpointError(f"{heads} attention heads do not divide into {kv_heads} KV heads")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"Gemma-4 drafter activation {activation!r} is not supported")
    softcap = cfg.get("final_logit_softcapping")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0
    ):
        raise CheckpointError(f"final_logit_softcapping must be positive, got {softcap!r}")
    layers = as_int(require(cfg, "num_hidden_layers"), "num_hidden_layers")
    # Gemma4TextMLP doubles its width in KV-shared layers when use_double_wide_mlp; the drafter
    # config keeps the target's num_kv_shared_layers, counted back from its own last layer.
    shared = as_int(cfg.get("num_kv_shared_layers", 0) or 0, "num_kv_shared_layers")
    wide = (
        tuple(range(max(0, layers - shared), layers))
        if shared and _flag(cfg, "use_double_wide_mlp")
        else ()
    )
    rope = _full_attention_rope(cfg)
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=as_int(require(cfg, "intermediate_size"), "intermediate_size"),
        vocab_size=as_int(require(cfg, "vocab_size"), "vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        attention_bias=_flag(cfg, "attention_bias"),
        backbone="gemma4",
        layer_types=("full_attention",) * layers,
        final_logit_softcapping=None if softcap is None else float(softcap),
        extra={
            "attention_k_eq_v": k_eq_v,
            "hidden_activation": activation,
            "double_wide_mlp_layers": wide,
        },
    )
