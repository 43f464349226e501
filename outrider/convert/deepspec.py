"""A canonical drafter description written back in DeepSpec's packaging.

DeepSpec's layout (deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/config.py`,
`.../modeling.py`): a flat Qwen3 config with `architectures ["Qwen3DSparkModel"]`,
`block_size`, `mask_token_id`, `target_layer_ids`, the Markov and confidence-head fields and
`tie_word_embeddings false`; tensors under their own names with the drafter's own frozen
`embed_tokens` / `lm_head`. It holds DSpark and DFlash block drafters of a Qwen3-style backbone
over the full vocabulary; anything else is refused by name rather than written half-right.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..core.checkpoint import read_config, read_safetensors
from ..core.drafter_spec import DrafterSpec
from ..core.errors import CheckpointError, OutriderError
from ..core.quantized import dequantize_tensors

KINDS = ("dspark", "dflash")


def refusal(spec: DrafterSpec) -> str | None:
    """Why this drafter cannot be written as DeepSpec, or None."""
    if spec.draft_vocab_size is not None:
        return (
            f"its reduced draft vocabulary ({spec.draft_vocab_size} of {spec.vocab_size} tokens, "
            "d2t) cannot be written as DeepSpec, whose head covers the whole vocabulary"
        )
    if spec.conv_kernel_size or spec.selector_rank or spec.kind == "dflash2":
        return "DFlash 2's convolutions and path selector cannot be written as DeepSpec"
    if spec.kind not in KINDS:
        return f"{spec.kind} drafters have no DeepSpec layout (DeepSpec ships dspark and dflash)"
    if spec.backbone != "qwen3":
        return f"its {spec.backbone} backbone cannot be written as a Qwen3DSparkModel"
    if spec.sliding_window or any(t != "full_attention" for t in spec.layer_types):
        return "its sliding-window draft layers cannot be written as DeepSpec (full attention only)"
    if spec.gated_q or spec.rope_dims:
        return "its gated queries / partial rotary (the qwen3_5-native fork) cannot be written as DeepSpec"
    if spec.causal_block or spec.attention_sinks:
        return "its causal block / attention sinks cannot be written as DeepSpec (bidirectional, no sinks)"
    if spec.output_multiplier != 1.0 or spec.final_logit_softcapping:
        return "its output multiplier / logit softcapping cannot be written as a Qwen3 DeepSpec drafter"
    if spec.ttt_length:
        return "EAGLE-3 drafters are not DeepSpec block drafters"
    if spec.extra:
        return f"its settings {', '.join(sorted(spec.extra))} have no DeepSpec config field"
    if spec.rope_traditional:
        return "its interleaved rope has no DeepSpec config field (DeepSpec ropes by halves)"
    if spec.logits_start not in (0, 1):
        return f"its first draft slot ({spec.logits_start}) has no DeepSpec meaning"
    return None


def target_embedding_and_head(target: Path, spec: DrafterSpec) -> tuple[mx.array, mx.array]:
    """The target's input embedding and output head (the embedding when tied), checked against
    the drafter's vocabulary and hidden size."""
    if target.is_file():
        raise OutriderError(
            f"--target {target.name}: pass the target's safetensors folder (not a single file)"
        )
    tensors = dequantize_tensors(read_safetensors(target), read_config(target))

    def find(suffix: str) -> mx.array | None:
        found = [v for k, v in tensors.items() if k.endswith(suffix) and "per_layer" not in k]
        return found[0] if len(found) == 1 else None

    embed = find("embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"target {target} has no single embed_tokens.weight tensor")
    head = find("lm_head.weight")
    head = embed if head is None else head
    want = (spec.vocab_size, spec.hidden_size)
    for name, arr in (("embedding", embed), ("output head", head)):
        if tuple(arr.shape) != want:
            raise OutriderError(
                f"the target's {name} is {tuple(arr.shape)}, the drafter needs {want}: "
                "--target names another model than the drafter's"
            )
    return embed, head


def deepspec_checkpoint(
    spec: DrafterSpec, target: Path | None = None
) -> tuple[dict, dict[str, mx.array], list[str]]:
    """(config.json, tensors, notes) of `spec` in DeepSpec's layout. A drafter that binds the
    target's embedding / head (z-lab DFlash) needs `target` to copy them from."""
    why = refusal(spec)
    if why:
        raise OutriderError(f"cannot write this {spec.format} drafter as DeepSpec: {why}")
    notes: list[str] = []
    weights = dict(spec.weights)
    if not (spec.own_embedding and spec.own_lm_head):
        if target is None:
            raise OutriderError(
                f"this {spec.format} drafter uses the target's embedding and output head, which "
                "a DeepSpec checkpoint carries itself: pass --target MODEL to copy them in"
            )
        embed, head = target_embedding_and_head(target, spec)
        if not spec.own_embedding:
            weights["embed_tokens.weight"] = embed
        if not spec.own_lm_head:
            weights["lm_head.weight"] = head
        notes.append(f"copied the embedding and output head of {target}")
    theta = spec.rope_theta
    rope = {"rope_type": "default", "rope_theta": theta}
    if spec.rope_scaling:
        rope = {**spec.rope_scaling, "rope_theta": theta}
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_bias": spec.attention_bias,
        "rope_parameters": rope,
        "layer_types": ["full_attention"] * spec.num_layers,
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
        "markov_rank": spec.markov_rank,
        "enable_confidence_head": spec.confidence_head,
        "tie_word_embeddings": False,
    }
    if spec.markov_rank > 0:
        config["markov_head_type"] = spec.markov_type
    if spec.confidence_head:
        config["confidence_head_with_markov"] = spec.confidence_with_markov
    if spec.confidence_temperatures:
        config["confidence_temperatures"] = list(spec.confidence_temperatures)
    if spec.logits_start == 1:
        config["logits_start"] = 1
        notes.append(
            "this drafter's anchor slot drafts nothing (its drafts start at slot 1): config.json "
            "records logits_start 1, which outrider reads and DeepSpec's own code would ignore"
        )
    return config, weights, notes
