"""vLLM speculators' packaging of DSpark and DFlash drafters (vllm-project/speculators).

The config is a pydantic model (`src/speculators/models/dflash/config.py`,
`src/speculators/models/dspark/config.py`): the drafter's own fields at the top level
(`speculators_model_type`, `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids`,
`sample_from_anchor`, `draft_vocab_size`, DSpark's Markov and confidence fields), the decoder
layers' dimensions in `transformer_layer_config`, and the verifier and proposal settings in
`speculators_config`. Three conventions differ from DeepSpec's:

- taps index HF `hidden_states`, so a speculators aux id is DeepSpec's tap id plus one;
- `sample_from_anchor` decides whether the anchor slot drafts (DSpark default) or only the mask
  slots do (DFlash default); `speculative_tokens` of the first proposal method says the same;
- the head may cover a reduced vocabulary: `lm_head` has `draft_vocab_size` rows and the buffers
  `d2t` (offsets to target ids) and `t2d` (a mask over target ids) map it back.

Some published heads ship neither `embed_tokens` nor `lm_head` and use the target's; that is
read from the tensors the checkpoint holds. `verifier_accept_k` / `accept_tolerance` describe a
lossy acceptance rule and are ignored: outrider's acceptance is always exact.
"""

from __future__ import annotations

from ...core.checkpoint import Checkpoint
from ...core.draft_vocab import read_draft_vocab
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import as_int, backbone_fields, layer_ids, strip_prefixes
from ...core.hookspecs import hookimpl

MODEL_TYPES = ("dspark", "dflash")
LAYER_TYPES = {"full_attention", "sliding_attention"}

# transformers' `Qwen3Config` defaults: older transformers serialise `transformer_layer_config`
# with `to_diff_dict`, which leaves out every value equal to these.
QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
}

# Tensors of the training-time verifier copy; excluded on save, but tolerated if present.
VERIFIER_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")


def draft_slots_start(cfg: dict, model_type: str, block_size: int) -> int:
    """The first block slot whose output is a draft (0: the anchor slot drafts too)."""
    if "sample_from_anchor" in cfg:
        if not isinstance(cfg["sample_from_anchor"], bool):
            raise CheckpointError(
                f"sample_from_anchor must be true or false, got {cfg['sample_from_anchor']!r}"
            )
        start = 0 if cfg["sample_from_anchor"] else 1
    else:
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
        first = methods[0] if isinstance(methods, list) and methods else None
        tokens = first.get("speculative_tokens") if isinstance(first, dict) else None
        if tokens is None:
            start = 0 if model_type == "dspark" else 1  # the pydantic defaults
        elif tokens in (block_size, block_size - 1):
            start = block_size - tokens
        else:
            raise CheckpointError(
                f"speculative_tokens {tokens} does not fit block_size {block_size} "
                f"(expected {block_size} or {block_size - 1})"
            )
    if block_size - start < 1:
        raise CheckpointError(f"block_size {block_size} leaves no draft slots")
    return start


def layer_config(cfg: dict) -> dict:
    """`transformer_layer_config` with Qwen3's defaults under it (speculators' DFlash / DSpark
    decoder layers are Qwen3 layers whatever `model_type` says)."""
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise CheckpointError("speculators config lacks the transformer_layer_config object")
    if tl.get("model_type", "qwen3") != "qwen3":
        # Other config classes have other defaults; take only what the file states.
        return dict(tl)
    out = dict(QWEN3_DEFAULTS)
    if "rope_parameters" in tl or "rope_scaling" in tl:
        out.pop("rope_theta")
    out.update(tl)
    return out


class SpeculatorsFormat:
    name = "speculators"
    description = "vLLM speculators DSpark / DFlash (DSparkSpeculator, DFlashSpeculator)"
    architectures = ("DSparkSpeculator", "DFlashSpeculator", "DSparkDraftModel")

    def detect(self, config: dict) -> bool:
        # Every speculators model but EAGLE-3 (read by the eagle3 format): an unknown type is
        # claimed here so that it is refused by name rather than as an unknown packaging.
        mtype = config.get("speculators_model_type")
        if mtype is not None:
            return mtype != "eagle3"
        archs = config.get("architectures") or []
        if "DSparkDraftModel" in archs:  # SpecForge's DSpark heads share this class name
            return isinstance(config.get("transformer_layer_config"), dict)
        return any(a in ("DSparkSpeculator", "DFlashSpeculator") for a in archs)

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        mtype = cfg.get("speculators_model_type")
        if mtype not in MODEL_TYPES:
            raise CheckpointError(
                f"speculators_model_type {mtype!r} is not supported by the speculators format "
                f"(it reads {', '.join(MODEL_TYPES)})"
            )
        dims = backbone_fields(layer_config(cfg))
        tl = cfg["transformer_layer_config"]
        layer_types = tuple(tl.get("layer_types") or ("full_attention",) * dims["num_layers"])
        if len(layer_types) != dims["num_layers"] or not set(layer_types) <= LAYER_TYPES:
            raise CheckpointError(
                f"transformer_layer_config.layer_types {list(layer_types)} does not describe "
                f"{dims['num_layers']} full / sliding attention layers"
            )
        window = tl.get("sliding_window")
        if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
            raise CheckpointError(f"sliding layers need a positive sliding_window, got {window!r}")
        block = as_int(cfg.get("block_size", 8), "block_size")
        if cfg.get("mask_token_id") is None:
            raise CheckpointError("speculators config has no mask_token_id")
        aux = cfg.get("aux_hidden_state_layer_ids")
        if not isinstance(aux, list) or not aux:
            raise CheckpointError(
                "speculators config lacks aux_hidden_state_layer_ids (the target layers it reads)"
            )
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux):
            raise CheckpointError(
                f"aux_hidden_state_layer_ids must be non-negative integers, got {aux!r}"
            )
        rank, markov_type, confidence, with_markov = 0, "vanilla", False, False
        if mtype == "dspark":  # defaults as in DSparkSpeculatorConfig
            rank = as_int(cfg.get("markov_rank", 256), "markov_rank")
            markov_type = cfg.get("markov_head_type", "vanilla")
            if markov_type not in ("vanilla", "gated", "rnn"):
                raise CheckpointError(f"unknown markov_head_type {markov_type!r}")
            confidence = bool(cfg.get("enable_confidence_head", True))
            with_markov = confidence and bool(cfg.get("confidence_head_with_markov", True))
            if with_markov and rank <= 0:
                raise CheckpointError("confidence_head_with_markov needs markov_rank > 0")
        vocab = dims["vocab_size"]
        draft_vocab = as_int(cfg.get("draft_vocab_size", vocab), "draft_vocab_size")
        if not 0 < draft_vocab <= vocab:
            raise CheckpointError(
                f"draft_vocab_size {draft_vocab} must be between 1 and the vocabulary ({vocab})"
            )
        mask = as_int(cfg["mask_token_id"], "mask_token_id")
        if not 0 <= mask < vocab:
            raise CheckpointError(f"mask_token_id {mask} is outside the vocabulary of {vocab}")
        weights = strip_prefixes(checkpoint.tensors)
        for name in VERIFIER_ONLY:
            weights.pop(name, None)
        if draft_vocab == vocab:  # identity maps, if a trainer saved them at all
            weights.pop("d2t", None)
            weights.pop("t2d", None)
        if draft_vocab < vocab:  # refuse a damaged map now, not when the strategy loads it
            read_draft_vocab(weights.get("d2t"), weights.get("t2d"), draft_vocab, vocab)
        spec = DrafterSpec(
            format=self.name,
            kind="dspark" if rank > 0 or confidence else "dflash",
            block_size=block,
            logits_start=draft_slots_start(cfg, mtype, block),
            mask_token_id=mask,
            # HF hidden_states[k] is the output of decoder layer k - 1 (k = 0: the embedding)
            target_layer_ids=layer_ids([i - 1 for i in aux], None),
            own_embedding="embed_tokens.weight" in weights,
            own_lm_head="lm_head.weight" in weights,
            markov_rank=rank,
            markov_type=markov_type,
            confidence_head=confidence,
            confidence_with_markov=with_markov,
            draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            # speculators: sliding layers are causal within the block unless this is set; full
            # attention layers are always bidirectional (`models/dflash/attention.py`)
            causal_sliding=not cfg.get("sliding_window_non_causal"),
            **dims,
        )
        spec.weights = weights
        return spec


@hookimpl
def register_drafter_formats(register):
    register(SpeculatorsFormat())
