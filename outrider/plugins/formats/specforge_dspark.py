"""SpecForge's DSpark packaging (sgl-project/SpecForge `specforge/modeling/draft/dspark.py`).

A z-lab DFlash backbone with DSpark's heads on top: `DSparkDraftModel`, a flat Qwen3 config with
`block_size` at the top level and the drafter's fields under `dflash_config` (`mask_token_id`,
`target_layer_ids` in z-lab's convention, `projector_type: "dspark"`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`). As in z-lab's
DFlash, the embedding and the head are the target's; unlike it, every block slot drafts: slot j
is trained on the token at anchor + j + 1, the anchor's own token seeding slot 0
(`specforge/core/dspark.py`, `OnlineDSparkModel.forward`: "there is no masked anchor slot,
unlike SpecForge DFlash which drops slot 0"), DeepSpec's convention. SpecForge's shared DFlash
generation loop slices from slot 1 (`draft_hidden[:, -block_size + 1:]`), which drafts every
token one position late (mlx-dspark measured acceptance 1.35 that way against 3.42). The Markov
head's first previous token is the anchor.
Early checkpoints kept the heads under a `logit_head.` container, which SpecForge maps away on
load (`normalize_draft_head_checkpoint_keys` in `specforge/modeling/draft/dflash.py`).
"""

from __future__ import annotations

from ...core.checkpoint import Checkpoint
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import as_int, backbone_fields, layer_ids, strip_prefixes
from ...core.hookspecs import hookimpl
from .zlab import default_layer_ids

HEAD_CONTAINER = "logit_head."


class SpecForgeDSparkFormat:
    name = "specforge-dspark"
    description = "SpecForge DSpark (DSparkDraftModel + dflash_config; target embed/head)"
    architectures = ("DSparkDraftModel",)

    def detect(self, config: dict) -> bool:
        # vLLM speculators also names heads DSparkDraftModel; theirs carry speculators fields.
        archs = config.get("architectures") or []
        return (
            "DSparkDraftModel" in archs
            and isinstance(config.get("dflash_config"), dict)
            and "speculators_model_type" not in config
        )

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        dcfg = cfg["dflash_config"]
        projector = dcfg.get("projector_type", "dspark")
        if projector != "dspark":
            raise CheckpointError(
                f"DSparkDraftModel with projector_type {projector!r} is not supported "
                "(SpecForge's DSpark heads use 'dspark')"
            )
        block = as_int(dcfg.get("block_size", cfg.get("block_size")), "block_size")
        if block < 2:
            raise CheckpointError(f"SpecForge DSpark block_size must be >= 2, got {block}")
        if dcfg.get("mask_token_id") is None:
            raise CheckpointError("SpecForge DSpark config has no dflash_config.mask_token_id")
        dims = backbone_fields(cfg)
        n_target = cfg.get("num_target_layers")
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise CheckpointError(
                    "SpecForge DSpark config has neither target_layer_ids nor num_target_layers"
                )
            ids = default_layer_ids(int(n_target), dims["num_layers"])
        rank = as_int(dcfg.get("markov_rank", 0) or 0, "markov_rank")
        markov_type = str(dcfg.get("markov_head_type", "vanilla")).lower()
        if markov_type not in ("vanilla", "gated", "rnn"):
            raise CheckpointError(f"unknown markov_head_type {markov_type!r}")
        alpha = float(dcfg.get("confidence_head_alpha", 0.0) or 0.0)
        confidence = bool(dcfg.get("enable_confidence_head", alpha > 0.0))
        with_markov = confidence and bool(dcfg.get("confidence_head_with_markov", False))
        if with_markov and rank <= 0:
            raise CheckpointError("confidence_head_with_markov needs markov_rank > 0")
        weights = strip_prefixes(checkpoint.tensors)
        weights = {k.removeprefix(HEAD_CONTAINER): v for k, v in weights.items()}
        spec = DrafterSpec(
            format=self.name,
            kind="dspark" if rank > 0 or confidence else "dflash",
            block_size=block,
            logits_start=0,  # every slot drafts (see above)
            mask_token_id=as_int(dcfg["mask_token_id"], "mask_token_id"),
            target_layer_ids=layer_ids(ids, n_target),
            own_embedding=False,
            own_lm_head=False,
            markov_rank=rank,
            markov_type=markov_type,
            confidence_head=confidence,
            confidence_with_markov=with_markov,
            **dims,
        )
        spec.weights = weights
        return spec


@hookimpl
def register_drafter_formats(register):
    register(SpecForgeDSparkFormat())
