"""Random-weight drafters for a tiny target, laid out like the published checkpoints."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core.drafter_spec import DrafterSpec
from .configs import text_config


def _weight(weights: dict, suffixes: tuple[str, ...], default=None):
    """The one tensor whose name ends with a suffix (embedding / head of any family)."""
    for name, value in weights.items():
        if name.endswith(suffixes) and "per_layer" not in name:
            return value
    if default is None:
        raise KeyError(f"no tensor named *{suffixes[0]}")
    return default


def default_tap_ids(num_layers: int, n: int = 3) -> list[int]:
    """Evenly spread taps below the last layer (DeepSpec never taps the final layer)."""
    n = max(1, min(n, num_layers - 1))
    step = (num_layers - 1) / n
    return sorted({int(i * step) for i in range(n)})


def make_tiny_drafter(
    path: str | Path,
    target: str | Path,
    kind: str = "dspark",
    packaging: str = "deepspec",
    *,
    num_layers: int = 2,
    block_size: int | None = None,
    markov_rank: int = 16,
    markov_type: str = "vanilla",
    confidence: bool = True,
    target_layer_ids: list[int] | None = None,
    seed: int = 1,
) -> Path:
    """Write a random-weight drafter for `target`, laid out like the published checkpoints."""
    from ..plugins.strategies.block_drafter import BlockDrafter

    if kind not in ("dspark", "dflash"):
        raise ValueError(f"kind must be dspark or dflash, got {kind!r}")
    if packaging not in ("deepspec", "zlab"):
        raise ValueError(f"packaging must be deepspec or zlab, got {packaging!r}")
    if packaging == "zlab" and kind != "dflash":
        raise ValueError("z-lab publishes DFlash drafters only")
    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = text_config(json.loads((target / "config.json").read_text()))
    for key in ("text_config", "vision_config", "audio_config", "quantization", "modules"):
        tcfg.pop(key, None)
    L = tcfg["num_hidden_layers"]
    ids = target_layer_ids or default_tap_ids(L)
    hidden, heads = tcfg["hidden_size"], tcfg["num_attention_heads"]
    mask_id = tcfg["vocab_size"] - 1  # <|mask|> is the last special token
    deepspec = packaging == "deepspec"
    rank = markov_rank if kind == "dspark" else 0
    block = block_size or (4 if deepspec else 8)
    spec = DrafterSpec(
        format=packaging,
        kind=kind,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=tcfg.get("num_key_value_heads", heads),
        head_dim=tcfg.get("head_dim", hidden // heads),
        intermediate_size=tcfg["intermediate_size"],
        vocab_size=tcfg["vocab_size"],
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        rope_theta=tcfg.get("rope_theta", 10000.0),
        block_size=block,
        logits_start=0 if deepspec else 1,
        mask_token_id=mask_id,
        target_layer_ids=tuple(ids),
        own_embedding=deepspec,
        own_lm_head=deepspec,
        markov_rank=rank,
        markov_type=markov_type,
        confidence_head=kind == "dspark" and confidence,
        confidence_with_markov=kind == "dspark" and confidence and rank > 0,
    )
    mx.random.seed(seed)
    model = BlockDrafter(spec)
    weights = dict(tree_flatten(model.parameters()))
    if deepspec:  # frozen copies of the target's embedding and head
        tw = mx.load(str(target / "model.safetensors"))
        embed = _weight(tw, ("embed_tokens.weight", "embeddings.weight"))
        weights["embed_tokens.weight"] = embed
        weights["lm_head.weight"] = _weight(tw, ("lm_head.weight",), embed)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if deepspec:
        cfg = copy.deepcopy(tcfg)
        cfg.update(
            architectures=["Qwen3DSparkModel"],
            model_type="qwen3",
            num_hidden_layers=num_layers,
            num_target_layers=L,
            layer_types=["full_attention"] * num_layers,
            block_size=block,
            mask_token_id=mask_id,
            target_layer_ids=ids,
            num_anchors=512,
            enable_confidence_head=spec.confidence_head,
            markov_rank=rank,
            tie_word_embeddings=False,
            head_dim=spec.head_dim,
        )
        if spec.confidence_head:
            cfg["confidence_head_with_markov"] = spec.confidence_with_markov
        if rank > 0:
            cfg["markov_head_type"] = markov_type
    else:
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": block,
            "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": ids},
            "hidden_size": hidden,
            "intermediate_size": tcfg["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "num_hidden_layers": num_layers,
            "num_target_layers": L,
            "rms_norm_eps": spec.rms_norm_eps,
            "rope_theta": spec.rope_theta,
            "vocab_size": tcfg["vocab_size"],
            "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # present on the hub; never run
        }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
