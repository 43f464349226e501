"""z-lab's DFlash packaging (z-lab/dflash): DFlashDraftModel.

DFlash fields live in `dflash_config` (block_size may sit at the top level in older releases);
no embedding or head is shipped (the target's are bound at run time); a block of B inputs yields
B-1 drafts (the anchor slot's output is discarded). Getting that slice wrong silently halves
acceptance, so it is fixed here, once. Layers listed as `sliding_attention` (with
`sliding_window`, unless `use_sliding_window` is false) see keys fewer than that many positions
away on either side, as z-lab's `Qwen3DFlashAttention` hands the window to a bidirectional
attention (`is_causal = False`).
"""

from __future__ import annotations

from ...core.checkpoint import Checkpoint
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import (
    as_int,
    attention_layers,
    backbone_fields,
    layer_ids,
    sliding_window,
    strip_prefixes,
)
from ...core.hookspecs import hookimpl


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule when a config lists no taps (z-lab/dflash, `dflash/model.py`).

    One draft layer taps the middle target layer; otherwise round(1 + i (L - 4) / (Ld - 1)) for
    i = 0..Ld-1, e.g. [1, 9, 17, 25, 33] for a 36-layer target and 5 draft layers.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class ZLabFormat:
    name = "zlab"
    description = "z-lab DFlash (DFlashDraftModel; anchor slot discarded, target embed/head)"
    architectures = ("DFlashDraftModel",)

    def detect(self, config: dict) -> bool:
        archs = [str(a) for a in config.get("architectures") or []]
        if any("DSpark" in a for a in archs) or "speculators_model_type" in config:
            return False  # DFlashSpeculator is vLLM speculators' packaging
        dcfg = config.get("dflash_config")
        if any("DFlash2" in a for a in archs) or (
            isinstance(dcfg, dict) and "conv_kernel_size" in dcfg
        ):
            return False  # DFlash 2 has its own format (formats/dflash2.py)
        return any(a.startswith("DFlash") for a in archs) or isinstance(
            config.get("dflash_config"), dict
        )

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        dcfg = cfg.get("dflash_config") or {}
        archs = [str(a) for a in cfg.get("architectures") or []]
        if (
            any("DFlash2" in a for a in archs)
            or "selector_rank" in dcfg
            or "conv_kernel_size" in dcfg
        ):
            raise CheckpointError("DFlash 2 drafters (DFlash2DraftModel) are not supported yet")
        if "markov_rank" in cfg or dcfg.get("projector_type") == "dspark":
            raise CheckpointError(
                "this z-lab-style checkpoint carries DSpark heads; that packaging is not supported yet"
            )

        def field(name: str):
            return dcfg.get(name, cfg.get(name))

        block = field("block_size")
        if block is None:
            raise CheckpointError(
                "z-lab DFlash config has no block_size (top level or dflash_config)"
            )
        mask = field("mask_token_id")
        if mask is None:
            raise CheckpointError("z-lab DFlash config has no mask_token_id")
        dims = backbone_fields(cfg)
        n_target = cfg.get("num_target_layers")
        ids = field("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise CheckpointError(
                    "z-lab DFlash config has neither target_layer_ids nor num_target_layers"
                )
            ids = default_layer_ids(int(n_target), dims["num_layers"])
        types = attention_layers(cfg, dims["num_layers"], "z-lab DFlash")
        window = sliding_window(cfg, types, "z-lab DFlash")
        spec = DrafterSpec(
            format=self.name,
            kind="dflash",
            block_size=as_int(block, "block_size"),
            logits_start=1,
            mask_token_id=as_int(mask, "mask_token_id"),
            target_layer_ids=layer_ids(ids, n_target),
            own_embedding=False,
            own_lm_head=False,
            layer_types=types if window else (),
            sliding_window=window,
            **dims,
        )
        if spec.block_size < 2:
            raise CheckpointError(f"z-lab DFlash block_size must be >= 2, got {spec.block_size}")
        spec.weights = strip_prefixes(checkpoint.tensors)
        return spec


@hookimpl
def register_drafter_formats(register):
    register(ZLabFormat())
