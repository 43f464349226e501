"""Random-weight DSpark / DFlash drafters in vLLM speculators' packaging.

Laid out as vllm-project/speculators saves them (`src/speculators/model.py` `DraftVocabMixin`,
`src/speculators/models/dflash/config.py`, `src/speculators/models/dspark/config.py`): a pydantic
config with `transformer_layer_config` and `speculators_config`, aux ids in HF `hidden_states`
indexing (DeepSpec's tap id + 1), bf16 weights with `embed_tokens` [V, H] and `lm_head`
[draft_vocab, H], and for a reduced vocabulary the buffers `d2t` [draft_vocab] int64 (offsets:
target id = draft id + d2t[draft id]) and `t2d` [V] bool.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .drafters import (
    PT,
    random_block_drafter,
    save_checkpoint,
    target_embedding_and_head,
)

SPECULATORS_VERSION = "0.4.0"


def draft_vocab_ids(vocab_size: int, draft_vocab_size: int, seed: int) -> list[int]:
    """A reproducible sorted subset of target ids for a reduced head (as `t2d` selects)."""
    order = mx.random.permutation(vocab_size, key=mx.random.key(seed)).tolist()
    return sorted(order[:draft_vocab_size])


def layer_config(tcfg: dict, spec) -> dict:
    """`transformer_layer_config`: the draft decoder's Qwen3 config (depth = draft layers)."""
    return {
        "model_type": "qwen3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * spec.num_layers,
        "tie_word_embeddings": False,
    }


def write_speculators_block(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    draft_vocab_size: int | None = None,
    sample_from_anchor: bool | None = None,
    share_target_head: bool = False,
    architecture: str | None = None,
    **overrides,
) -> Path:
    """A speculators `dspark` / `dflash` drafter.

    `draft_vocab_size` < V writes a reduced head with `d2t` / `t2d`; `sample_from_anchor`
    defaults as speculators does (DSpark true, DFlash false); `share_target_head` leaves out
    `embed_tokens` and `lm_head` (heads that use the target's); `architecture` overrides the
    class name (published DSpark heads carry `DSparkDraftModel`).
    """
    anchor_drafts = (kind == "dspark") if sample_from_anchor is None else sample_from_anchor
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=0 if anchor_drafts else 1,
        own_embedding=not share_target_head, own_lm_head=not share_target_head,
        format="speculators", draft_vocab_size=draft_vocab_size, **overrides,
    )  # fmt: skip
    vocab, reduced = spec.vocab_size, spec.draft_vocab_size is not None
    if reduced:
        ids = draft_vocab_ids(vocab, draft_vocab_size, seed)
        weights["d2t"] = mx.array([t - i for i, t in enumerate(ids)], dtype=mx.int64)
        t2d = mx.zeros((vocab,), dtype=mx.bool_)
        t2d[mx.array(ids)] = True
        weights["t2d"] = t2d
    if not share_target_head:
        embed, head = target_embedding_and_head(target)
        weights["embed_tokens.weight"] = embed
        weights["lm_head.weight"] = head[mx.array(ids)] if reduced else head
    weights = {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    block, start = spec.block_size, spec.logits_start
    cfg = {
        "architectures": [
            architecture or f"{'DSpark' if kind == 'dspark' else 'DFlash'}Speculator"
        ],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(tcfg, spec),
        "draft_vocab_size": draft_vocab_size if reduced else vocab,
        "block_size": block,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [j + 1 for j in spec.target_layer_ids],
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": anchor_drafts,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - start,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target),
                "architectures": json.loads((target / "config.json").read_text()).get(
                    "architectures", []
                ),
            },
        },
        "torch_dtype": "bfloat16",
    }
    if kind == "dspark":
        cfg.update(
            markov_rank=spec.markov_rank,
            markov_head_type=spec.markov_type,
            enable_confidence_head=spec.confidence_head,
            confidence_head_with_markov=spec.confidence_with_markov,
        )
    return save_checkpoint(path, weights, cfg, PT)
