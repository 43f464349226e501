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
from ...core.hookspecs import hookimpl
from .deepspec import deepspec_spec, hoisted

ARCHITECTURE = "Lfm2DSparkDraftModel"
NESTED = ("mask_token_id", "target_layer_ids", "num_target_layers")  # under dflash_config


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
        ids = {k: dcfg[k] for k in NESTED if dcfg.get(k) is not None}  # as published
        for name in NESTED[:2]:
            if name not in ids and cfg.get(name) is None:
                raise CheckpointError(f"LiquidAI DSpark config has no dflash_config.{name}")
        neox = cfg.get("rope_is_neox_style", True)
        if not isinstance(neox, bool):
            raise CheckpointError(f"rope_is_neox_style must be true or false, got {neox!r}")
        # DeepSpec's flat shape: the ids as published, then the top level's fields
        flat = {**hoisted(cfg), **ids}
        flat["markov_rank"] = flat.get("markov_rank") or 0
        flat["markov_head_type"] = str(flat.get("markov_head_type", "vanilla")).lower()
        # vLLM's Lfm2DSparkForCausalLM: the confidence head reads the Markov head unless told
        flat.setdefault("confidence_head_with_markov", True)
        spec = deepspec_spec(flat, checkpoint.tensors, self.name)
        spec.rope_traditional = not neox
        return spec


@hookimpl
def register_drafter_formats(register):
    register(LiquidDSparkFormat())
