"""LiquidAI's DSpark packaging for LFM2 / LFM2.5 targets (the LiquidAI/LFM2.5-*-DSpark repos).

A DeepSpec-style Qwen3 block drafter (`architectures ["Lfm2DSparkDraftModel"]`, `model_type
"qwen3"`) whose config differs from DeepSpec's in four ways:

- `mask_token_id`, `target_layer_ids` and `num_target_layers` live only under `dflash_config`,
  which, unlike SpecForge's, carries no `projector_type`;
- the Markov and confidence fields sit at the top level, and a confidence head reads the
  Markov head unless `confidence_head_with_markov` says otherwise (vLLM's
  `Lfm2DSparkForCausalLM` sets it so when the field is absent);
- `rope_is_neox_style: false` means interleaved (GPT-J) rope pairs;
- no embedding or output head is shipped: the LFM2 target's tied embedding serves both.

As in DeepSpec, a block of B inputs (the anchor, then B - 1 masks) yields B drafts: the anchor
slot predicts the next token (mlx-dspark's `logits_start` 0 for this packaging).
"""

from __future__ import annotations

from ...core.checkpoint import Checkpoint
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import as_int, backbone_fields, layer_ids, strip_prefixes
from ...core.hookspecs import hookimpl

ARCHITECTURE = "Lfm2DSparkDraftModel"


class LiquidDSparkFormat:
    name = "liquid-dspark"
    description = (
        "LiquidAI LFM2.5 DSpark (Lfm2DSparkDraftModel; anchor slot predicts, interleaved rope, "
        "target embed/head)"
    )
    architectures = (ARCHITECTURE,)

    def detect(self, config: dict) -> bool:
        archs = config.get("architectures") or []
        dcfg = config.get("dflash_config")
        return (
            ARCHITECTURE in archs
            and isinstance(dcfg, dict)
            and "projector_type" not in dcfg
            and "speculators_model_type" not in config
        )

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        dcfg = cfg["dflash_config"]

        def field(name: str):  # dflash_config first, as published; the top level as a fallback
            value = dcfg.get(name, cfg.get(name))
            if value is None:
                raise CheckpointError(f"LiquidAI DSpark config has no dflash_config.{name}")
            return value

        block = as_int(cfg.get("block_size"), "block_size")
        if block < 1:
            raise CheckpointError(f"block_size must be >= 1, got {block}")
        n_target = dcfg.get("num_target_layers", cfg.get("num_target_layers"))
        rank = as_int(cfg.get("markov_rank", dcfg.get("markov_rank", 0)) or 0, "markov_rank")
        markov_type = str(cfg.get("markov_head_type", "vanilla")).lower()
        if markov_type not in ("vanilla", "gated", "rnn"):
            raise CheckpointError(f"unknown markov_head_type {markov_type!r}")
        confidence = bool(cfg.get("enable_confidence_head", False))
        with_markov = confidence and rank > 0 and bool(cfg.get("confidence_head_with_markov", True))
        neox = cfg.get("rope_is_neox_style", True)
        if not isinstance(neox, bool):
            raise CheckpointError(f"rope_is_neox_style must be true or false, got {neox!r}")
        weights = strip_prefixes(checkpoint.tensors)
        spec = DrafterSpec(
            format=self.name,
            kind="dspark" if rank > 0 or confidence else "dflash",
            block_size=block,
            logits_start=0,
            mask_token_id=as_int(field("mask_token_id"), "mask_token_id"),
            target_layer_ids=layer_ids(field("target_layer_ids"), n_target),
            own_embedding="embed_tokens.weight" in weights,
            own_lm_head="lm_head.weight" in weights,
            markov_rank=rank,
            markov_type=markov_type,
            confidence_head=confidence,
            confidence_with_markov=with_markov,
            rope_traditional=not neox,
            **backbone_fields(cfg),
        )
        spec.weights = weights
        return spec


@hookimpl
def register_drafter_formats(register):
    register(LiquidDSparkFormat())
