"""A new drafter for a target, and writing it in DeepSpec's packaging.

The config is a copy of the target's with DeepSpec's drafter fields (deepseek-ai/DeepSpec,
`deepspec/modeling/dspark/qwen3/config.py`: `num_target_layers`, `block_size`, `mask_token_id`,
`target_layer_ids`, the Markov and confidence-head fields, `tie_word_embeddings` false; for
EAGLE-3 `deepspec/modeling/eagle3/qwen3/config.py`: one layer, `ttt_length`,
`step_loss_decay`); the weights are DeepSpec's tensor names, with frozen copies of the target's
embedding and output head. The DeepSpec and EAGLE-3 format plugins read both back, so a trained
drafter loads with `--drafter`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..core.checkpoint import Checkpoint
from ..core.drafter_spec import DrafterSpec
from ..core.errors import OutriderError
from ..core.target import Target
from ..plugins.formats.deepspec import DeepSpecFormat
from ..plugins.formats.eagle3 import Eagle3Format
from ..plugins.strategies.block_drafter import BlockDrafter
from ..plugins.strategies.eagle3_drafter import Eagle3Drafter

# Fields of a target's config that describe its packaging, not a drafter's.
DROPPED = ("quantization", "quantization_config", "auto_map", "layer_types", "text_config")


def default_layers(num_target_layers: int) -> int:
    """Draft depth: DeepSpec uses 5 layers for 36-40 layer targets; small targets get fewer."""
    return max(1, min(5, num_target_layers // 6))


def default_taps(num_target_layers: int, n: int = 5) -> list[int]:
    """z-lab's spread (DeepSpec's Qwen3 lists: [1, 9, 17, 25, 33] for 36 layers), never the
    last layer; small targets get every layer below the last."""
    L = num_target_layers
    n = max(1, min(n, L - 1))
    if n == 1:
        return [L // 2]
    ids = [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    if L >= 8 and all(b > a for a, b in zip(ids, ids[1:])) and ids[-1] < L - 1:
        return ids
    step = (L - 1) / n
    return sorted({int(i * step) for i in range(n)})


def mask_token_id(target: Target, vocab_size: int) -> int:
    """An id the tokenizer never produces when the embedding has spare rows (Qwen3: 151669),
    else a declared mask token, else the last row."""
    tok = target.tokenizer
    size = len(tok) if hasattr(tok, "__len__") else vocab_size
    if size < vocab_size:
        return size
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    for name in (getattr(tok, "mask_token", None), "<|mask|>", "<mask>"):
        if name and name in vocab and vocab[name] < vocab_size:
            return int(vocab[name])
    return vocab_size - 1


def target_text_config(target: Target) -> dict:
    cfg = dict(target.config)
    cfg.update(cfg.get("text_config") or {})
    return cfg


def drafter_config(
    target: Target,
    kind: str,
    *,
    num_layers: int,
    block_size: int,
    tap_ids: list[int],
    markov_rank: int,
    markov_type: str,
    num_anchors: int,
) -> dict:
    """DeepSpec's config.json for a new drafter of `target` (for EAGLE-3, `block_size` is the
    training-time-test depth, `ttt_length`)."""
    tcfg = target_text_config(target)
    cfg = {k: v for k, v in copy.deepcopy(tcfg).items() if k not in DROPPED}
    hidden, heads = int(tcfg["hidden_size"]), int(tcfg["num_attention_heads"])
    vocab = int(tcfg["vocab_size"])
    shape = dict(
        model_type="qwen3",  # the drafter's own layers are Qwen3's (q/k norms), any target
        num_target_layers=target.num_layers,
        target_layer_ids=list(tap_ids),
        tie_word_embeddings=False,
        head_dim=int(tcfg.get("head_dim") or hidden // heads),
        num_key_value_heads=int(tcfg.get("num_key_value_heads") or heads),
    )
    if kind == "eagle3":
        if num_layers != 1:
            raise OutriderError(f"EAGLE-3 drafters have one layer, not {num_layers} (--layers)")
        cfg.update(
            architectures=["Qwen3Eagle3Model"],
            num_hidden_layers=1,
            draft_num_hidden_layers=1,
            layer_types=["full_attention"],
            ttt_length=block_size,
            step_loss_decay=0.8,
            **shape,
        )
        return cfg
    dspark = kind == "dspark"
    rank = markov_rank if dspark else 0
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        num_hidden_layers=num_layers,
        layer_types=["full_attention"] * num_layers,
        block_size=block_size,
        mask_token_id=mask_token_id(target, vocab),
        num_anchors=num_anchors,
        enable_confidence_head=dspark,
        markov_rank=rank,
        **shape,
    )
    if dspark:
        cfg["confidence_head_with_markov"] = rank > 0
    if rank > 0:
        cfg["markov_head_type"] = markov_type
    return cfg


def is_eagle3(config: dict) -> bool:
    return "Qwen3Eagle3Model" in (config.get("architectures") or [])


def spec_from(config: dict, weights: dict[str, mx.array]) -> DrafterSpec:
    """The canonical description, read by the format plugin that reads it back."""
    fmt = Eagle3Format() if is_eagle3(config) else DeepSpecFormat()
    return fmt.translate(Checkpoint(Path("."), config, dict(weights)))


def network(spec: DrafterSpec) -> nn.Module:
    """The inference network of a drafter kind: what training updates is what decoding runs."""
    return Eagle3Drafter(spec) if spec.kind == "eagle3" else BlockDrafter(spec)


def _dense_weight(module: nn.Module) -> mx.array:
    """A linear/embedding weight, dequantised when the target is quantised."""
    if "scales" in module:
        return mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
        )
    return module.weight


def target_embedding_and_head(target: Target) -> tuple[mx.array, mx.array]:
    """The target's input embedding and output head as dense [V, H] matrices."""
    model = target.model
    inner = None
    for name in ("model", "language_model", "backbone", "transformer"):
        if name in model and isinstance(model[name], nn.Module):
            inner = model[name]
            break
    if inner is None or "embed_tokens" not in inner:
        raise OutriderError("cannot find the target's embedding to copy into the drafter")
    embed = _dense_weight(inner["embed_tokens"])
    head = _dense_weight(model["lm_head"]) if "lm_head" in model else embed
    return embed, head


def initial_weights(config: dict, target: Target, seed: int) -> dict[str, mx.array]:
    """Random drafter weights (mlx's initialisers) with the target's embedding and head."""
    spec = spec_from(config, {})
    mx.random.seed(seed)
    model = network(spec)
    weights = dict(tree_flatten(model.parameters()))
    embed, head = target_embedding_and_head(target)
    weights["embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    return weights


def save_drafter(path: Path, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype) -> None:
    """config.json + model.safetensors, DeepSpec's names, in `dtype`."""
    path.mkdir(parents=True, exist_ok=True)
    cast = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    config = dict(config)
    config["torch_dtype"] = {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    mx.save_safetensors(str(path / "model.safetensors"), cast, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
