"""DFlash 2 packaging (Inco AI; reference code z-lab/dflash `dflash/model.py`, DFlash2DraftModel).

The z-lab DFlash backbone (fields under `dflash_config`, the target's embedding and head bound at
run time, B inputs -> B-1 drafts) plus, per draft layer, grouped dynamic causal convolutions
around attention and MLP, and a candidate selector walked from the anchor. The published
safetensors store the selector's codebooks without a `.weight` suffix (z-lab maps them onto
`nn.Embedding.weight` with a `key_mapping`); a `.weight` spelling is accepted too.
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
from .zlab import default_layer_ids

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def is_dflash2(config: dict) -> bool:
    """A third-party detector's rule: an architecture naming DFlash2, or conv fields present."""
    archs = [str(a) for a in config.get("architectures") or []]
    dcfg = config.get("dflash_config")
    has_conv = isinstance(dcfg, dict) and "conv_kernel_size" in dcfg
    return any("DFlash2" in a for a in archs) or has_conv


def _positive(dcfg: dict, key: str) -> int:
    if key not in dcfg:
        raise CheckpointError(f"DFlash 2 config lacks dflash_config.{key}")
    value = as_int(dcfg[key], key)
    if value < 1:
        raise CheckpointError(f"DFlash 2 dflash_config.{key} must be >= 1, got {value}")
    return value


def _number(value, key: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"DFlash 2 dflash_config.{key} must be a number, got {value!r}")
    return float(value)


def _check_shape(tensors: dict, name: str, shape: tuple[int, ...]) -> None:
    if name not in tensors:
        raise CheckpointError(f"DFlash 2 checkpoint is missing tensor {name}")
    got = tuple(tensors[name].shape)
    if got != shape:
        raise CheckpointError(f"DFlash 2 tensor {name} has shape {got}, expected {shape}")


class DFlash2Format:
    name = "dflash2"
    description = "DFlash 2 (DFlash2DraftModel; dynamic convs + candidate selector, target head)"
    architectures = ("DFlash2DraftModel",)

    def detect(self, config: dict) -> bool:
        return is_dflash2(config)

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict):
            raise CheckpointError("DFlash 2 config has no dflash_config object")

        def field(name: str, default=None):
            return dcfg.get(name, cfg.get(name, default))

        dims = backbone_fields(cfg)
        block = as_int(field("block_size", 16), "block_size")
        if block < 2:
            raise CheckpointError(f"DFlash 2 block_size must be >= 2, got {block}")
        mask = field("mask_token_id")
        if mask is None:
            raise CheckpointError("DFlash 2 config lacks dflash_config.mask_token_id")
        kernel = _positive(dcfg, "conv_kernel_size")
        group = _positive(dcfg, "conv_group_size")
        rank = _positive(dcfg, "selector_rank")
        top_k = _positive(dcfg, "selector_top_k")
        hidden, vocab = dims["hidden_size"], dims["vocab_size"]
        if hidden % group:
            raise CheckpointError(
                f"DFlash 2 conv_group_size {group} does not divide hidden_size {hidden}"
            )
        if top_k > vocab:
            raise CheckpointError(
                f"DFlash 2 selector_top_k {top_k} exceeds the vocabulary size {vocab}"
            )
        softcap = _number(field("final_logit_softcapping"), "final_logit_softcapping", 0.0)
        n_target = cfg.get("num_target_layers")
        ids = field("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise CheckpointError(
                    "DFlash 2 config has neither target_layer_ids nor num_target_layers"
                )
            ids = default_layer_ids(int(n_target), dims["num_layers"])
        types = attention_layers(cfg, dims["num_layers"], "DFlash 2")
        is_causal = cfg.get("is_causal")
        spec = DrafterSpec(
            format=self.name,
            kind="dflash2",
            block_size=block,
            logits_start=1,
            mask_token_id=as_int(mask, "mask_token_id"),
            target_layer_ids=layer_ids(ids, n_target),
            own_embedding=False,
            own_lm_head=False,
            layer_types=types,
            sliding_window=sliding_window(cfg, types, "DFlash 2"),
            conv_kernel_size=kernel,
            conv_group_size=group,
            selector_rank=rank,
            selector_top_k=top_k,
            output_multiplier=_number(field("output_multiplier"), "output_multiplier", 1.0),
            final_logit_softcapping=softcap if softcap > 0 else None,
            extra={
                "input_embedding_scale": _number(
                    field("input_embedding_scale"), "input_embedding_scale", 1.0
                ),
                # z-lab: a layer is causal when the config says so, else when it slides.
                "is_causal": None if is_causal is None else bool(is_causal),
            },
            **dims,
        )
        spec.weights = self._weights(checkpoint, spec)
        return spec

    def _weights(self, checkpoint: Checkpoint, spec: DrafterSpec) -> dict:
        tensors = strip_prefixes(checkpoint.tensors)
        for name in CODEBOOKS:
            key = f"candidate_selector.{name}"
            if key not in tensors and f"{key}.weight" in tensors:
                tensors[key] = tensors.pop(f"{key}.weight")
        h, r, v, k = spec.hidden_size, spec.selector_rank, spec.vocab_size, spec.conv_kernel_size
        for name in CODEBOOKS:
            _check_shape(tensors, f"candidate_selector.{name}", (v, r))
        _check_shape(tensors, "candidate_selector.hidden_projection.weight", (r, h))
        dynamic = 2 * k * (h // spec.conv_group_size)
        for i in range(spec.num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                _check_shape(tensors, f"layers.{i}.{conv}.base_kernel", (2, k, h))
                _check_shape(tensors, f"layers.{i}.{conv}.kernel_projection.weight", (dynamic, h))
        return tensors


@hookimpl
def register_drafter_formats(register):
    register(DFlash2Format())
