"""The contract a drafter-format plugin fulfils, and the shared config readers."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .checkpoint import Checkpoint
from .drafter_spec import DrafterSpec
from .errors import CheckpointError


@runtime_checkable
class DrafterFormat(Protocol):
    name: str
    description: str
    # the config.json `architectures` values it reads; registry rows name one per drafter
    architectures: tuple[str, ...]

    def detect(self, config: dict) -> bool:
        """True when this packaging claims the checkpoint (from config.json alone)."""

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        """The canonical description + weights, or CheckpointError naming the reason."""


def require(config: dict, key: str, where: str = "config.json"):
    if key not in config:
        raise CheckpointError(f"drafter {where} lacks the required field {key!r}")
    return config[key]


def as_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"drafter config field {key!r} must be an integer, got {value!r}")
    return value


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling config) from either `rope_theta`/`rope_scaling` or the newer
    transformers `rope_parameters` block."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else dict(params))
    theta = float(config.get("rope_theta", 1_000_000.0))
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and "original_max_position_embeddings" in config:
        # Phi-3's LongRoPE keeps its original context beside the scaling, not in it
        scaling = {
            "original_max_position_embeddings": config["original_max_position_embeddings"],
            **scaling,
        }
    return theta, scaling


def layer_ids(value, num_target_layers: int | None) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise CheckpointError(
            f"target_layer_ids must be a non-empty list of integers, got {value!r}"
        )
    if any(b <= a for a, b in zip(value, value[1:])):
        raise CheckpointError(f"target_layer_ids must be strictly increasing, got {value}")
    if value[0] < -1 or (num_target_layers is not None and value[-1] >= num_target_layers):
        raise CheckpointError(
            f"target_layer_ids {value} fall outside the target's {num_target_layers} layers"
        )
    return tuple(value)


def backbone_fields(config: dict) -> dict:
    """Dimensions of a Qwen3-style drafter backbone, validated."""
    hidden = as_int(require(config, "hidden_size"), "hidden_size")
    heads = as_int(require(config, "num_attention_heads"), "num_attention_heads")
    theta, scaling = rope_settings(config)
    return dict(
        hidden_size=hidden,
        num_layers=as_int(require(config, "num_hidden_layers"), "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=as_int(config.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=as_int(config.get("head_dim") or hidden // heads, "head_dim"),
        intermediate_size=as_int(require(config, "intermediate_size"), "intermediate_size"),
        vocab_size=as_int(require(config, "vocab_size"), "vocab_size"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        attention_bias=bool(config.get("attention_bias", False)),
    )


def strip_prefixes(tensors: dict) -> dict:
    """Drop packaging prefixes (`_orig_mod.` from torch.compile, a shared `model.`)."""
    out = {k.removeprefix("_orig_mod."): v for k, v in tensors.items()}
    if out and all(k.startswith("model.") for k in out):
        out = {k.removeprefix("model."): v for k, v in out.items()}
    return out


LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_layers(config: dict, num_layers: int, what: str) -> tuple[str, ...]:
    """Each draft layer's attention (`layer_types`, transformers' field), checked; all full
    attention when the config lists none. `what` names the packaging in a refusal."""
    types = config.get("layer_types")
    if types is None:
        return ("full_attention",) * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(
            f"{what} layer_types must list one entry per draft layer ({num_layers}), got {types!r}"
        )
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise CheckpointError(f"{what} layer_types has unknown layer type {unknown[0]!r}")
    return tuple(types)


def sliding_window(config: dict, types: tuple[str, ...], what: str) -> int | None:
    """The sliding layers' window; None when no layer slides, or (as transformers' Qwen3Config
    reads it) when `use_sliding_window` is false."""
    if "sliding_attention" not in types or config.get("use_sliding_window") is False:
        return None
    window = config.get("sliding_window")
    if window is None:
        raise CheckpointError(f"{what} config has sliding_attention layers but no sliding_window")
    window = as_int(window, "sliding_window")
    if window < 2:
        raise CheckpointError(f"{what} sliding_window must be >= 2, got {window}")
    return window
