"""DeepSpec's packaging (deepseek-ai/DeepSpec): DSpark and DeepSpec-DFlash drafters.

Flat config (a copy of the target's with block_size, mask_token_id, target_layer_ids, markov and
confidence fields); own frozen embed_tokens / lm_head copies; block of B inputs yields B drafts
(the anchor slot predicts the next token). Some repacks (Nanbeige's Nanbeige4.2-3B-DSpark)
keep the mask id, the taps and the heads' fields in a SpecForge-style `dflash_config` instead,
and ship no embedding or head: a field missing at the top level is read from there.

Heads of the DFlash lineage in this layout (NVIDIA's Nemotron-3.5-Lightning DSpark head) add,
at either level: `dspark_bonus_anchor: true` / `sample_from_anchor: false` (the anchor is the
last committed token and slots 1.. are the drafts, as z-lab's; vLLM's `DSparkSpeculator` reads
`dspark_bonus_anchor`), `causal` (a causal block), `use_swa` with `swa_window_size` (every
layer slides over that many positions) and `attention_sink_bias` (a learned sink logit per
head). NVIDIA's config leaves the confidence head out; its tensors say whether there is one.

The qwen3_5-native fork (`Qwen35DSparkModel` with `enable_qwen35_gated_q_proj`, Ornith's heads)
is this layout with Qwen3.5's attention and norms: q_proj yields [q ‖ gate] per head and the
attention output is scaled by sigmoid(gate), rope turns the first `partial_rotary_factor` of each
head, and every RMSNorm weight is stored as its offset from one (Qwen3.5's (1 + w) · x̂), which
is added back here. The rest of such a config (mrope sections, vision and linear-attention
fields) is the target's, copied, and ignored.

A head may ship `confidence_temperatures`, one per draft slot: the post-hoc calibration of its
confidence head (the DSpark paper's sequential temperature scaling, §3.2.1), read as slot j's
estimate = sigmoid(logit / T_j). They change only how far a round drafts, never the output.
"""

from __future__ import annotations

import math

from ...core.checkpoint import Checkpoint
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import as_int, backbone_fields, layer_ids, require, strip_prefixes
from ...core.hookspecs import hookimpl
from .deepspec_gemma4 import gemma4_backbone_fields, is_gemma4


class DeepSpecFormat:
    name = "deepspec"
    description = "DeepSpec DSpark / DFlash (Qwen3DSparkModel; anchor slot predicts)"
    architectures = ("Qwen3DSparkModel", "Gemma4DSparkModel", "Qwen35DSparkModel")

    def detect(self, config: dict) -> bool:
        archs = config.get("architectures") or []
        return any(isinstance(a, str) and a.endswith("DSparkModel") for a in archs)

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = hoisted(checkpoint.config)
        spec = deepspec_spec(cfg, checkpoint.tensors, self.name)
        native = cfg.get("enable_qwen35_gated_q_proj", False)
        if not isinstance(native, bool):
            raise CheckpointError(
                "drafter config field 'enable_qwen35_gated_q_proj' must be true or false"
            )
        if native:
            qwen35_native(cfg, spec)
        return spec


def deepspec_spec(cfg: dict, tensors: dict, name: str) -> DrafterSpec:
    """The spec of a DeepSpec-layout drafter from its flat config (other packagings of the same
    head, e.g. LiquidAI's, bring theirs to this shape first) and its tensors."""
    # NVIDIA's head states it twice (`dspark_markov_rank`, vLLM's name, and `markov_rank`)
    rank = as_int(cfg.get("markov_rank", cfg.get("dspark_markov_rank", 0)), "markov_rank")
    markov_type = cfg.get("markov_head_type", "vanilla") if rank > 0 else "vanilla"
    if markov_type not in ("vanilla", "gated", "rnn"):
        raise CheckpointError(f"unknown markov_head_type {markov_type!r}")
    # DeepSpec saves frozen copies of the target's embedding and head; repacks of this
    # layout that leave them out use the target's (checked against its vocabulary at load).
    weights = strip_prefixes(tensors)
    confidence, with_markov = confidence_fields(cfg, weights, rank)
    n_target = cfg.get("num_target_layers")
    spec = DrafterSpec(
        format=name,
        kind="dspark" if rank > 0 or confidence else "dflash",
        block_size=as_int(require(cfg, "block_size"), "block_size"),
        # 1 for heads whose anchor is the bonus token, and in `outrider convert` output of z-lab
        # drafters (anchor slot discarded)
        logits_start=1 if bonus_anchor(cfg) or cfg.get("logits_start") == 1 else 0,
        mask_token_id=as_int(require(cfg, "mask_token_id"), "mask_token_id"),
        target_layer_ids=layer_ids(require(cfg, "target_layer_ids"), n_target),
        own_embedding="embed_tokens.weight" in weights,
        own_lm_head="lm_head.weight" in weights,
        markov_rank=rank,
        markov_type=markov_type,
        confidence_head=confidence,
        confidence_with_markov=with_markov,
        **(gemma4_backbone_fields(cfg) if is_gemma4(cfg) else backbone_fields(cfg)),
    )
    if spec.block_size < 1:
        raise CheckpointError(f"block_size must be >= 1, got {spec.block_size}")
    block_attention(cfg, spec)
    spec.confidence_temperatures = temperatures(cfg, spec)
    spec.weights = weights
    return spec


def temperatures(cfg: dict, spec: DrafterSpec) -> tuple[float, ...]:
    """The confidence head's per-slot temperatures, one for each slot the head drafts."""
    values = cfg.get("confidence_temperatures")
    if values is None or not spec.confidence_head:
        return ()  # nothing to calibrate without a confidence head
    ok = isinstance(values, list) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        for t in values
    )
    if not ok:
        raise CheckpointError(
            f"confidence_temperatures must be a list of positive numbers, got {values!r}"
        )
    if len(values) != spec.max_draft:
        raise CheckpointError(
            f"confidence_temperatures has {len(values)} values; this head drafts "
            f"{spec.max_draft} tokens a call and needs one for each"
        )
    return tuple(float(t) for t in values)


def qwen35_native(cfg: dict, spec: DrafterSpec) -> None:
    """Ornith's fork: gated queries, partial rotary, norms back from their offsets."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    dims = int(spec.head_dim * factor)
    if dims % 2 or dims < 2:
        raise CheckpointError(
            f"partial_rotary_factor {factor} ropes {dims} of {spec.head_dim} head dims; rope "
            "needs an even number"
        )
    spec.gated_q = True
    spec.rope_dims = dims if dims < spec.head_dim else None
    spec.weights = {
        name: w + 1 if name.endswith("norm.weight") and w.ndim == 1 else w
        for name, w in spec.weights.items()
    }


def bonus_anchor(cfg: dict) -> bool:
    """Whether the block's anchor slot holds the bonus token (slots 1.. draft) rather than
    predicting (DeepSpec's own heads); the two fields that say so must agree."""
    bonus, from_anchor = cfg.get("dspark_bonus_anchor"), cfg.get("sample_from_anchor")
    for key, value in (("dspark_bonus_anchor", bonus), ("sample_from_anchor", from_anchor)):
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"drafter config field {key!r} must be true or false")
    if bonus is not None and from_anchor is not None and bonus == from_anchor:
        raise CheckpointError(
            f"drafter config says dspark_bonus_anchor {str(bonus).lower()} and "
            f"sample_from_anchor {str(from_anchor).lower()}, which contradict each other"
        )
    return bonus if bonus is not None else from_anchor is False


def confidence_fields(cfg: dict, weights: dict, rank: int) -> tuple[bool, bool]:
    """(a confidence head?, does it read the Markov head?): as the config says, else (NVIDIA's
    config says neither) as the head's tensors say."""
    proj = weights.get("confidence_head.proj.weight")
    if "enable_confidence_head" in cfg:
        confidence = bool(cfg["enable_confidence_head"])
    else:
        confidence = proj is not None
    if not confidence or rank == 0:
        return confidence, False
    if "confidence_head_with_markov" in cfg or proj is None:
        return True, bool(cfg.get("confidence_head_with_markov"))
    return True, proj.shape[-1] > as_int(require(cfg, "hidden_size"), "hidden_size")


def block_attention(cfg: dict, spec: DrafterSpec) -> None:
    """The DFlash lineage's block attention, where the config asks for it: causal block,
    one sliding window for every layer, per-head sinks."""
    for key in ("causal", "use_swa", "attention_sink_bias"):
        if not isinstance(cfg.get(key, False), bool):
            raise CheckpointError(f"drafter config field {key!r} must be true or false")
    spec.causal_block = cfg.get("causal", False)
    spec.attention_sinks = cfg.get("attention_sink_bias", False)
    if cfg.get("use_swa"):
        window = as_int(require(cfg, "swa_window_size"), "swa_window_size")
        if window < 2:
            raise CheckpointError(f"swa_window_size must be >= 2, got {window}")
        spec.sliding_window = window
        spec.layer_types = ("sliding_attention",) * spec.num_layers


HOISTED = (
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "confidence_temperatures",
    # the DFlash lineage's block attention and anchor (NVIDIA's Nemotron head nests them)
    "sample_from_anchor",
    "causal",
    "use_swa",
    "swa_window_size",
    "attention_sink_bias",
)


def hoisted(config: dict) -> dict:
    """The config with the drafter fields a nested `dflash_config` holds brought to the top
    level where the top level lacks them."""
    nested = config.get("dflash_config")
    if not isinstance(nested, dict):
        return config
    return {**{k: nested[k] for k in HOISTED if k in nested}, **config}


@hookimpl
def register_drafter_formats(register):
    register(DeepSpecFormat())
