"""Toy-size configs of real mlx-lm / mlx-vlm architectures, one entry per model_type."""

from __future__ import annotations

SANDWICH_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")

# Tiny sliding windows, so that short generations wrap them many times over.
SLIDING_WINDOW = 8

_GATED_DELTA = {  # every other layer gated-delta-net linear attention, the rest full attention
    "head_dim": 16,
    "tie_word_embeddings": False,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
_MROPE = {
    "type": "default",
    "mrope_section": [2, 1, 1],
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}

FAMILIES = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": False},
    "llama": {
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False},
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False},  # fused qkv, gate|up
    "mixtral": {  # mlx-lm's Mixtral: a llama with experts (GGUF files are `llama` ones)
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "qwen2_moe": {  # Qwen1.5-MoE / Qwen2-MoE: qwen2's attention, experts and a gated shared one
        "model_type": "qwen2_moe",
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {"model_type": "qwen3_5", **_GATED_DELTA, "rope_parameters": _MROPE},
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        **_GATED_DELTA,
        "rope_parameters": _MROPE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "head_dim": 16,
        "tie_word_embeddings": False,
        "hybrid_override_pattern": ["M", "*", "M", "E"],
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    "lfm2": {  # LiquidAI LFM2: gated short-convolution layers, and full attention between them
        "model_type": "lfm2",
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "tie_word_embeddings": True,
    },
    "lfm2_moe": {  # LFM2.5-8B-A1B's shape: a dense first layer, then routed experts
        "model_type": "lfm2_moe",
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "tie_word_embeddings": True,
    },
    "nanbeige": {  # Nanbeige4.2's looped depth: the layer stack run twice, normed in between
        "model_type": "nanbeige",
        "head_dim": 16,
        "num_hidden_layers": 2,
        "num_loops": 2,
        "tie_word_embeddings": False,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": True,
        "final_logit_softcapping": 30.0,
    },
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {  # one global layer in two (real models: one in six)
        "model_type": "gemma3_text",
        "head_dim": 16,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
    "prism_hadamard_qwen35": {  # Ternary-Bonsai packs: 2-bit weights, Hadamard-rotated inputs
        "model_type": "prism_hadamard_qwen35",
        "text_config": "qwen3_5",
        # packed input widths are multiples of 128; Hadamard blocks are 512 or more
        "text_overrides": {"hidden_size": 128, "intermediate_size": 512},
        "schema_version": 1,
        "tensor_namespace": "mlx-lm-text",
        "gdn_activation_layout": "grouped",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [
            {
                "path": f"model.layers.{i}.mlp.{proj}",
                "embedding": False,
                "dtype": "float16",
                "block": block,
            }
            for i in range(4)
            for proj, block in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 512))
        ],
    },
    "gemma4": {  # the mlx-vlm multimodal checkpoint: language tower + a toy vision tower
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": "gemma4_text",
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 4,
            "position_embedding_size": 64,
            "pooling_kernel_size": 2,
            "default_output_length": 4,
        },
        "audio_config": None,
        "image_token_id": 258,
        "audio_token_id": 259,
        "boi_token_id": 257,
        "eoi_token_id": 256,
        "boa_token_id": 255,
        "eoa_token_id": 254,
    },
    "muse_glimmer_vlm": {  # the mlx-vlm multimodal checkpoint of muse_glimmer
        "model_type": "muse_glimmer",
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "text_config": "muse_glimmer",
        "text_overrides": {
            "model_type": "muse_glimmer_text",
            "bos_token_id": None,
            "eos_token_id": None,
        },
        "vision_config": {
            "model_type": "muse_glimmer_vision",
            "patch_size": 4,
            "merge_size": 2,
            "pos_emb_height": 4,
            "pos_emb_width": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "max_position_embeddings": 64,
        },
        "image_token_id": 258,
        "video_token_id": 259,
        "out_hidden_size": 64,
        "projector_hidden_size": 64,
    },
    "muse_glimmer": {
        "model_type": "muse_glimmer",
        "head_dim": 16,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
    },
}


def tiny_config(family: str = "qwen3", vocab_size: int = 262, **overrides) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"make_tiny_target knows {sorted(FAMILIES)}, not {family!r}")
    cfg = {
        "architectures": ["TinyForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    spec = FAMILIES[family]
    if "text_config" in spec:  # a multimodal checkpoint: the text model's config nests
        overrides = {**spec.get("text_overrides", {}), **overrides}
        text = tiny_config(spec["text_config"], vocab_size, **overrides)
        for key in ("architectures", "torch_dtype"):
            text.pop(key)
        top = {k: v for k, v in spec.items() if k not in ("text_config", "text_overrides")}
        top.setdefault("architectures", ["TinyForConditionalGeneration"])
        top.update(text_config=text, vocab_size=text["vocab_size"], torch_dtype="float32")
        top["hidden_size"] = text["hidden_size"]
        return top
    cfg.update(spec)
    cfg.update(overrides)
    return cfg


def text_config(config: dict) -> dict:
    """The language model's fields, whether config.json nests them or not."""
    return {**config, **config.get("text_config", {})}
