"""Random-weight EAGLE-3 drafters for a tiny target, in each publisher's layout.

- `deepspec`: deepseek-ai/DeepSpec `Qwen3Eagle3Model` (`deepspec/modeling/eagle3/qwen3/config.py`
  `build_draft_config`): the target's config copied, one layer, `target_layer_ids`, `ttt_length`
  7, frozen bf16 copies of the target's embedding and head.
- `speculators`: vllm-project/speculators eagle3 (`src/speculators/models/eagle3/config.py`,
  `src/speculators/model.py`): `transformer_layer_config` (qwen3, or llama with `layer="llama"`),
  aux ids one above DeepSpec's, `embed_tokens`, a `draft_vocab_size` head with `d2t` [Vd] int64
  offsets and `t2d` [V] bool when reduced.
- `specforge`: sgl-project/SpecForge `LlamaForCausalLMEagle3` as its SGLang export writes it
  (`specforge/export/to_sglang.py`): Llama config, `eagle_config` taps (DeepSpec ids),
  `midlayer.*`, no embedding, `lm_head` [Vd, H], `d2t`, `t2d` (always, identity when full).

Writers given the same seed, backbone and taps write the same weights, so tests can compare
packagings draft for draft. Overrides: `target_layer_ids` (DeepSpec convention),
`draft_vocab_size` (with `draft_vocab_ids`, the target ids a reduced head covers), `layer`
("qwen3" | "llama") and `embedding` (False: none shipped), speculators only; `seed`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core.drafter_spec import DrafterSpec
from .drafters import PT, save_checkpoint, target_embedding_and_head, target_text_config

SPECULATORS_VERSION = "0.4.0"


def default_eagle3_taps(num_layers: int) -> list[int]:
    """Up to five evenly spread taps below the last layer (DeepSpec never taps the last)."""
    n = min(5, num_layers - 1)
    return sorted({round(i * (num_layers - 2) / max(1, n - 1)) for i in range(n)})


def eagle3_spec(
    tcfg: dict,
    *,
    fmt: str,
    backbone: str,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
) -> DrafterSpec:
    """The canonical spec of a random EAGLE-3 drafter for a target config."""
    hidden, heads = tcfg["hidden_size"], tcfg["num_attention_heads"]
    vocab = tcfg["vocab_size"]
    return DrafterSpec(
        format=fmt,
        kind="eagle3",
        hidden_size=hidden,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=tcfg.get("num_key_value_heads", heads),
        head_dim=tcfg.get("head_dim") or hidden // heads,
        intermediate_size=tcfg["intermediate_size"],
        vocab_size=vocab,
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        rope_theta=tcfg.get("rope_theta", 10000.0),
        block_size=1,
        logits_start=0,
        mask_token_id=0,  # unused by EAGLE-3
        target_layer_ids=tuple(target_layer_ids or default_eagle3_taps(tcfg["num_hidden_layers"])),
        draft_vocab_size=draft_vocab_size if draft_vocab_size not in (None, vocab) else None,
        backbone=backbone,
        ttt_length=7,
    )


def eagle3_weights(
    spec: DrafterSpec, target: Path, seed: int, vocab_ids: list[int] | None = None
) -> dict[str, mx.array]:
    """Canonical (DeepSpec-named) bf16 weights: random layer, the target's embedding and head
    (the head's rows restricted to the draft vocabulary when reduced), plus d2t / t2d.

    A reduced head covers `vocab_ids` (target ids), else a seeded random subset."""
    from ..plugins.strategies.eagle3_drafter import Eagle3Drafter

    mx.random.seed(seed)
    base = DrafterSpec(**{**spec.__dict__, "own_embedding": False, "own_lm_head": False})
    weights = dict(tree_flatten(Eagle3Drafter(base).parameters()))
    embed, head = target_embedding_and_head(target)
    weights["embed_tokens.weight"] = embed
    if spec.draft_vocab_size is None:
        weights["lm_head.weight"] = head
    else:
        if vocab_ids is None:
            order = mx.random.permutation(spec.vocab_size, key=mx.random.key(seed)).tolist()
            vocab_ids = order[: spec.draft_vocab_size]
        ids = sorted(vocab_ids)
        if len(set(ids)) != spec.draft_vocab_size:
            raise ValueError(f"draft_vocab_ids must list {spec.draft_vocab_size} distinct ids")
        weights["lm_head.weight"] = head[mx.array(ids)]
        weights["d2t"] = mx.array(ids, dtype=mx.int64) - mx.arange(len(ids), dtype=mx.int64)
        weights["t2d"] = mx.zeros((spec.vocab_size,), dtype=mx.bool_)
        weights["t2d"][mx.array(ids)] = True
    return {
        k: v if v.dtype in (mx.int64, mx.bool_) else v.astype(mx.bfloat16)
        for k, v in weights.items()
    }


def write_deepspec_eagle3(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
) -> Path:
    """DeepSpec's Qwen3Eagle3Model (full vocabulary only: DeepSpec ships no d2t)."""
    if draft_vocab_size is not None:
        raise ValueError("DeepSpec EAGLE-3 drafters always use the full vocabulary")
    tcfg = target_text_config(target)
    spec = eagle3_spec(tcfg, fmt="deepspec", backbone="qwen3", target_layer_ids=target_layer_ids)
    cfg = copy.deepcopy(tcfg)
    cfg.update(
        architectures=["Qwen3Eagle3Model"],
        model_type="qwen3",
        num_target_layers=tcfg["num_hidden_layers"],
        num_hidden_layers=1,
        layer_types=["full_attention"],
        target_model_name_or_path="/mnt/train/models/target",  # the trainer's path; ignored
        target_layer_ids=list(spec.target_layer_ids),
        ttt_length=spec.ttt_length,
        step_loss_decay=0.8,
        draft_num_hidden_layers=1,
        tie_word_embeddings=False,
        head_dim=spec.head_dim,
        torch_dtype="bfloat16",
    )
    return save_checkpoint(path, eagle3_weights(spec, target, seed), cfg, PT)


def _layer_config(tcfg: dict, spec: DrafterSpec, model_type: str) -> dict:
    out = {
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if model_type == "llama":
        out["mlp_bias"] = False
    return out


def write_speculators_eagle3(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    draft_vocab_ids: list[int] | None = None,
    layer: str = "qwen3",
    embedding: bool = True,
) -> Path:
    """vLLM speculators' eagle3 (Eagle3SpeculatorConfig), Qwen3 or Llama decoder layer;
    `embedding=False` leaves out `embed_tokens` (speculators then loads the verifier's)."""
    tcfg = target_text_config(target)
    spec = eagle3_spec(
        tcfg,
        fmt="speculators",
        backbone=layer,
        target_layer_ids=target_layer_ids,
        draft_vocab_size=draft_vocab_size,
    )
    target_cfg = json.loads((target / "config.json").read_text())
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(tcfg, spec, layer),
        "draft_vocab_size": spec.draft_vocab_size or spec.vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [j + 1 for j in spec.target_layer_ids],
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target),
                "architectures": target_cfg.get("architectures", []),
            },
        },
        "torch_dtype": "bfloat16",
    }
    weights = eagle3_weights(spec, target, seed, draft_vocab_ids)
    if not embedding:
        del weights["embed_tokens.weight"]
    return save_checkpoint(path, weights, cfg, PT)


def write_specforge_eagle3(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    draft_vocab_ids: list[int] | None = None,
) -> Path:
    """SpecForge's LlamaForCausalLMEagle3 as exported for SGLang (no embedding)."""
    tcfg = target_text_config(target)
    spec = eagle3_spec(
        tcfg,
        fmt="specforge",
        backbone="llama",
        target_layer_ids=target_layer_ids,
        draft_vocab_size=draft_vocab_size,
    )
    weights = eagle3_weights(spec, target, seed, draft_vocab_ids)
    del weights["embed_tokens.weight"]
    if spec.draft_vocab_size is None:  # SpecForge always registers the buffers
        weights["d2t"] = mx.zeros((spec.vocab_size,), dtype=mx.int64)
        weights["t2d"] = mx.ones((spec.vocab_size,), dtype=mx.bool_)
    weights = {
        ("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
        for k, v in weights.items()
    }
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(spec.target_layer_ids),
            "use_aux_hidden_state": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "model_type": "llama",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size or spec.vocab_size,
    }
    return save_checkpoint(path, weights, cfg, PT)
