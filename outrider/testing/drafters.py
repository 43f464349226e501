"""Random-weight drafters for a tiny target, laid out like the published checkpoints.

`make_tiny_drafter(path, target, kind, packaging)` picks the writer of that (kind, packaging)
pair from `WRITERS`; each writer lives with the packaging it imitates. The pieces every writer
shares (the target's text config, its embedding and head, a block drafter's canonical spec and
random weights) live here.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core.drafter_spec import DrafterSpec
from .configs import text_config

KINDS = ("dspark", "dflash", "dflash2", "eagle3")
PACKAGINGS = (
    "deepspec", "zlab", "speculators", "specforge", "liquid", "nvidia", "ornith", "gguf",
)  # fmt: skip

# (kind, packaging) -> "module:function"; a writer is
# writer(path: Path, target: Path, kind: str, **overrides) -> Path (the folder, or a .gguf file).
WRITERS: dict[tuple[str, str], str] = {
    ("dspark", "deepspec"): "outrider.testing.drafters:write_deepspec_block",
    ("dflash", "deepspec"): "outrider.testing.drafters:write_deepspec_block",
    ("dflash", "zlab"): "outrider.testing.drafters:write_zlab_dflash",
    ("eagle3", "deepspec"): "outrider.testing.drafters_eagle3:write_deepspec_eagle3",
    ("eagle3", "speculators"): "outrider.testing.drafters_eagle3:write_speculators_eagle3",
    ("eagle3", "specforge"): "outrider.testing.drafters_eagle3:write_specforge_eagle3",
    ("dspark", "speculators"): "outrider.testing.drafters_speculators:write_speculators_block",
    ("dflash", "speculators"): "outrider.testing.drafters_speculators:write_speculators_block",
    ("dspark", "specforge"): "outrider.testing.drafters_specforge_dspark:write_specforge_dspark",
    ("dflash2", "zlab"): "outrider.testing.drafters_dflash2:write_dflash2",
    ("dspark", "gguf"): "outrider.testing.drafters_gguf:write_prismml_dspark",
    ("dspark", "liquid"): "outrider.testing.drafters_liquid:write_liquid_dspark",
    ("dspark", "nvidia"): "outrider.testing.drafters_nvidia:write_nvidia_dspark",
    ("dspark", "ornith"): "outrider.testing.drafters_ornith:write_ornith_dspark",
}


def make_tiny_drafter(
    path: str | Path,
    target: str | Path,
    kind: str = "dspark",
    packaging: str = "deepspec",
    **overrides: Any,
) -> Path:
    """Write a random-weight `kind` drafter for `target` in `packaging`'s published layout.

    Overrides reach the writer (for block drafters: num_layers, block_size, markov_rank,
    markov_type, confidence, target_layer_ids, seed). An unknown kind or packaging, or a pair no
    publisher ships, is refused by name.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if packaging not in PACKAGINGS:
        raise ValueError(f"packaging must be one of {', '.join(PACKAGINGS)}, got {packaging!r}")
    ref = WRITERS.get((kind, packaging))
    if ref is None:
        offered = sorted(p for k, p in WRITERS if k == kind)
        raise ValueError(
            f"the {packaging} packaging has no {kind} drafters"
            + (f" ({kind} comes in: {', '.join(offered)})" if offered else "")
        )
    module, func = ref.split(":")
    writer = getattr(importlib.import_module(module), func)
    return writer(Path(path), Path(target), kind, **overrides)


# ---- pieces shared by the writers ------------------------------------------------------------


def target_text_config(target: Path) -> dict:
    """The target's text config, without multimodal or quantization sections."""
    tcfg = text_config(json.loads((target / "config.json").read_text()))
    for key in ("text_config", "vision_config", "audio_config", "quantization", "modules"):
        tcfg.pop(key, None)
    return tcfg


def _named(weights: dict, suffixes: tuple[str, ...]) -> str | None:
    """The name of the one tensor that ends with a suffix (embedding / head of any family)."""
    return next((n for n in weights if n.endswith(suffixes) and "per_layer" not in n), None)


def _weight(weights: dict, suffixes: tuple[str, ...], default=None):
    """The one tensor whose name ends with a suffix (embedding / head of any family)."""
    name = _named(weights, suffixes)
    if name is not None:
        return weights[name]
    if default is None:
        raise KeyError(f"no tensor named *{suffixes[0]}")
    return default


def target_embedding_and_head(target: Path) -> tuple[mx.array, mx.array]:
    """The target's input embedding and output head (the embedding when tied), dequantized
    where the target stores them quantized (mlx-lm's `quantization` config)."""
    tw = mx.load(str(target / "model.safetensors"))
    quant = json.loads((target / "config.json").read_text()).get("quantization") or {}

    def read(suffixes: tuple[str, ...], default=None) -> mx.array:
        name = _named(tw, suffixes)
        stem = "" if name is None else name[: -len("weight")]
        if name is None or stem + "scales" not in tw:
            return _weight(tw, suffixes, default)
        scales = tw[stem + "scales"]
        return mx.dequantize(
            tw[name],
            scales,
            tw.get(stem + "biases"),
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
        ).astype(scales.dtype)

    embed = read(("embed_tokens.weight", "embeddings.weight"))
    return embed, read(("lm_head.weight",), embed)


def target_layers(tcfg: dict) -> int:
    """The layers a drafter's taps index: a looped-depth target's unrolled stream (its stack
    times its loops, as mlx-lm's nanbeige counts them), else its stack."""
    loops = tcfg.get("num_loops", 1) or 1
    if tcfg.get("loop_loss_weights"):
        loops = len(tcfg["loop_loss_weights"]) + 1
    return tcfg["num_hidden_layers"] * loops


def default_tap_ids(num_layers: int, n: int = 3) -> list[int]:
    """Evenly spread taps below the last layer (DeepSpec never taps the final layer)."""
    n = max(1, min(n, num_layers - 1))
    step = (num_layers - 1) / n
    return sorted({int(i * step) for i in range(n)})


def block_spec(
    tcfg: dict,
    kind: str,
    *,
    logits_start: int,
    own_embedding: bool,
    own_lm_head: bool,
    format: str,
    num_layers: int = 2,
    block_size: int | None = None,
    markov_rank: int = 16,
    markov_type: str = "vanilla",
    confidence: bool = True,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
) -> DrafterSpec:
    """The canonical spec of a random DSpark / DFlash block drafter for a target config
    (`draft_vocab_size`: a reduced head of that many rows)."""
    hidden, heads = tcfg["hidden_size"], tcfg["num_attention_heads"]
    rank = markov_rank if kind == "dspark" else 0
    ids = target_layer_ids or default_tap_ids(target_layers(tcfg))
    vocab = tcfg["vocab_size"]
    if draft_vocab_size is not None and draft_vocab_size >= vocab:
        draft_vocab_size = None  # a head as wide as the vocabulary is not a reduced one
    return DrafterSpec(
        format=format,
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
        block_size=block_size or (4 if logits_start == 0 else 8),
        logits_start=logits_start,
        mask_token_id=tcfg["vocab_size"] - 1,  # <|mask|> is the last special token
        target_layer_ids=tuple(ids),
        own_embedding=own_embedding,
        own_lm_head=own_lm_head,
        markov_rank=rank,
        markov_type=markov_type,
        confidence_head=kind == "dspark" and confidence,
        confidence_with_markov=kind == "dspark" and confidence and rank > 0,
        draft_vocab_size=draft_vocab_size,
    )


def random_block_weights(spec: DrafterSpec, seed: int = 1) -> dict[str, mx.array]:
    """Random weights of a block drafter under their canonical (DeepSpec) names."""
    from ..plugins.strategies.block_drafter import BlockDrafter

    mx.random.seed(seed)
    return dict(tree_flatten(BlockDrafter(spec).parameters()))


def random_block_drafter(
    target: Path, kind: str, seed: int = 1, **spec_args
) -> tuple[dict, DrafterSpec, dict[str, mx.array]]:
    """(the target's text config, a block drafter's spec, its random weights): what every
    block-drafter writer starts from; `spec_args` reach `block_spec`."""
    tcfg = target_text_config(target)
    spec = block_spec(tcfg, kind, **spec_args)
    return tcfg, spec, random_block_weights(spec, seed)


def save_checkpoint(
    path: Path, weights: dict[str, mx.array], config: dict, metadata: dict | None = None
) -> Path:
    """Write `model.safetensors` (with the publisher's safetensors `metadata`, if any) and
    `config.json` into the folder `path`."""
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata=metadata)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


PT = {"format": "pt"}  # what checkpoints saved from PyTorch carry in their safetensors header


def deepspec_config(tcfg: dict, spec: DrafterSpec, architecture: str = "Qwen3DSparkModel") -> dict:
    """DeepSpec's config.json: a copy of the target's with the drafter's fields on top."""
    cfg = copy.deepcopy(tcfg)
    cfg.update(
        architectures=[architecture],
        model_type=tcfg.get("model_type", "qwen3"),
        num_hidden_layers=spec.num_layers,
        num_target_layers=target_layers(tcfg),
        layer_types=["full_attention"] * spec.num_layers,
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        num_anchors=512,
        enable_confidence_head=spec.confidence_head,
        markov_rank=spec.markov_rank,
        tie_word_embeddings=False,
        head_dim=spec.head_dim,
    )
    if spec.confidence_head:
        cfg["confidence_head_with_markov"] = spec.confidence_with_markov
    if spec.markov_rank > 0:
        cfg["markov_head_type"] = spec.markov_type
    return cfg


# ---- the writers of the packagings outrider started with -------------------------------------


def write_deepspec_block(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    share_target_head: bool = False,
    **overrides,
) -> Path:
    """DeepSpec's Qwen3 DSpark / DFlash: flat config, frozen copies of embedding and head
    (`share_target_head=True`: neither, as SpecForge / SGLang style repacks ship it)."""
    from .drafters_gemma4 import is_gemma4_target, write_deepspec_gemma4

    if is_gemma4_target(target):  # DeepSpec's Gemma4DSparkModel
        return write_deepspec_gemma4(path, target, kind, seed, **overrides)
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=0, own_embedding=True, own_lm_head=True,
        format="deepspec", **overrides,
    )  # fmt: skip
    weights["embed_tokens.weight"], weights["lm_head.weight"] = target_embedding_and_head(target)
    if share_target_head:
        del weights["embed_tokens.weight"], weights["lm_head.weight"]
    cfg = deepspec_config(tcfg, spec)
    cfg["model_type"] = "qwen3"
    return save_checkpoint(path, weights, cfg)


def write_zlab_dflash(path: Path, target: Path, kind: str, seed: int = 1, **overrides) -> Path:
    """z-lab's DFlash: fields under dflash_config, no embedding or head (the target's)."""
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=1, own_embedding=False, own_lm_head=False,
        format="zlab", **overrides,
    )  # fmt: skip
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": spec.block_size,
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # present on the hub; never run
    }
    return save_checkpoint(path, weights, cfg)
