"""EAGLE-3 drafter packagings, each translated to one canonical description (kind "eagle3").

- DeepSpec `Qwen3Eagle3Model` (deepseek-ai/DeepSpec `deepspec/modeling/eagle3/qwen3/config.py`,
  `modeling.py`): a copy of the target's config plus `target_layer_ids` (DeepSpec convention: id
  j is the output of decoder layer j), `ttt_length`, `num_target_layers`; tensors `fc`,
  `layers.0.*` (Qwen3 q/k norms), `norm`, frozen `embed_tokens` / `lm_head` copies, full vocab.
- vLLM speculators eagle3 (vllm-project/speculators `src/speculators/models/eagle3/config.py`,
  `core.py`, `src/speculators/model.py`): `speculators_model_type` "eagle3", the layer's config
  in `transformer_layer_config` (qwen3 or llama), taps in `eagle_aux_hidden_state_layer_ids`
  indexing HF `hidden_states` (so DeepSpec id = aux id - 1; default [2, L//2, L-3]); tensors
  named as DeepSpec's, a `draft_vocab_size` head with `d2t` offsets and `t2d` when reduced.
- SpecForge `LlamaForCausalLMEagle3` (sgl-project/SpecForge
  `specforge/modeling/draft/llama3_eagle.py`, `specforge/export/to_sglang.py`): a Llama config
  with `draft_vocab_size`, taps in `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang adds
  one to reach the layer whose *input* it captures, so these are DeepSpec ids already; default
  [1, L//2-1, L-4]); tensors `midlayer.*` (no q/k norms), `fc`, `norm`, `lm_head`, `d2t`, `t2d`,
  and the embedding only when exported for Hugging Face (the SGLang export drops it: the
  target's is bound).
"""

from __future__ import annotations

from ...core.checkpoint import Checkpoint
from ...core.draft_vocab import read_draft_vocab
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ...core.formats import as_int, backbone_fields, layer_ids, strip_prefixes
from ...core.hookspecs import hookimpl

DEEPSPEC_ARCHS = ("Qwen3Eagle3Model", "Gemma4Eagle3Model")
SPECFORGE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3DraftModel")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
BACKBONES = {"qwen3": "qwen3", "llama": "llama"}  # decoder layer model_type -> canonical


def packaging(config: dict) -> str | None:
    """Which EAGLE-3 packaging a config is, from config.json alone (None: not EAGLE-3)."""
    if config.get("speculators_model_type") is not None:
        return "speculators" if config.get("speculators_model_type") == "eagle3" else None
    archs = [str(a) for a in config.get("architectures") or []]
    if any(a in DEEPSPEC_ARCHS for a in archs):
        return "deepspec"
    if "Eagle3DraftModel" in archs and "target_layer_ids" in config:
        return "deepspec"  # DeepSpec's eval.py reads this name with its own layout
    if any(a in SPECFORGE_ARCHS for a in archs):
        return "specforge"
    return None


def _vocab_fields(tensors: dict, vocab: int, draft_vocab: int) -> tuple[int | None, dict]:
    """(draft_vocab_size or None, tensors without t2d); a reduced head's d2t / t2d checked."""
    tensors = dict(tensors)
    t2d = tensors.pop("t2d", None)
    if draft_vocab > vocab:
        raise CheckpointError(f"draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
    if draft_vocab == vocab:
        tensors.pop("d2t", None)  # an identity map, when a packaging writes one anyway
        return None, tensors
    read_draft_vocab(tensors.get("d2t"), t2d, draft_vocab, vocab)
    return draft_vocab, tensors


def _canonical_spec(
    fmt: str,
    dims: dict,
    taps: tuple[int, ...],
    tensors: dict,
    *,
    backbone: str,
    ttt_length: int,
    draft_vocab: int,
    extra: dict,
) -> DrafterSpec:
    if dims["num_layers"] != 1:
        raise CheckpointError(
            f"EAGLE-3 drafters with {dims['num_layers']} layers are not supported (one layer, "
            "as DeepSpec's evaluator requires)"
        )
    if ttt_length < 1:
        raise CheckpointError(f"ttt_length must be >= 1, got {ttt_length}")
    reduced, tensors = _vocab_fields(tensors, dims["vocab_size"], draft_vocab)
    spec = DrafterSpec(
        format=fmt,
        kind="eagle3",
        block_size=1,
        logits_start=0,
        mask_token_id=0,  # unused: EAGLE-3 never drafts from a mask (0 passes pair checks)
        target_layer_ids=taps,
        own_embedding="embed_tokens.weight" in tensors,
        own_lm_head="lm_head.weight" in tensors,
        draft_vocab_size=reduced,
        backbone=backbone,
        layer_types=("full_attention",),
        ttt_length=ttt_length,
        extra=extra,
        **dims,
    )
    if not spec.own_lm_head and reduced is not None:
        raise CheckpointError("reduced-vocabulary EAGLE-3 checkpoint has no lm_head.weight")
    spec.weights = tensors
    return spec


def _translate_deepspec(cfg: dict, tensors: dict) -> DrafterSpec:
    archs = [str(a) for a in cfg.get("architectures") or []]
    if "Gemma4Eagle3Model" in archs:
        raise CheckpointError("Gemma-4 EAGLE-3 drafters (Gemma4Eagle3Model) are not supported yet")
    if "target_layer_ids" not in cfg:
        raise CheckpointError("DeepSpec EAGLE-3 config lacks the required field 'target_layer_ids'")
    n_target = cfg.get("num_target_layers")
    taps = layer_ids(cfg["target_layer_ids"], n_target)
    if taps[0] < 0:
        raise CheckpointError(f"EAGLE-3 taps decoder layers only, got target_layer_ids {taps}")
    dims = backbone_fields(cfg)
    return _canonical_spec(
        "deepspec",
        dims,
        taps,
        strip_prefixes(tensors),
        backbone="qwen3",
        ttt_length=as_int(cfg.get("ttt_length", 7), "ttt_length"),
        draft_vocab=as_int(cfg.get("draft_vocab_size") or dims["vocab_size"], "draft_vocab_size"),
        extra={},
    )


def _check_target_hidden(cfg: dict, hidden: int) -> None:
    th = cfg.get("target_hidden_size")
    if th is not None and th != hidden:
        raise CheckpointError(
            f"EAGLE-3 drafter reads a {th}-wide target through a {hidden}-wide layer; "
            "drafters narrower than their target are not supported"
        )


def _translate_speculators(cfg: dict, tensors: dict) -> DrafterSpec:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("speculators eagle3 config lacks transformer_layer_config")
    mtype = layer.get("model_type", "qwen3")  # speculators' default decoder layer is Qwen3
    if mtype not in BACKBONES:
        raise CheckpointError(
            f"speculators eagle3 decoder layer model_type {mtype!r} is not supported "
            f"(supported: {', '.join(BACKBONES)})"
        )
    dims = backbone_fields(layer)
    _check_target_hidden(cfg, dims["hidden_size"])
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        raise CheckpointError(
            "speculators eagle3 config has no eagle_aux_hidden_state_layer_ids (its default "
            "depends on the verifier's depth, which the checkpoint does not record)"
        )
    if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
        raise CheckpointError(f"eagle_aux_hidden_state_layer_ids must list integers, got {aux!r}")
    # speculators id k is HF hidden_states[k], the output of layer k - 1
    taps = layer_ids([i - 1 for i in aux], None)
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    ttt = methods[0].get("speculative_tokens", 3) if isinstance(methods[0], dict) else 3
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        raise CheckpointError("speculators eagle3 config sets both norm_before_fc and fc_norm")
    extra = {
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "input_norm": bool(cfg.get("norm_before_fc", False)),
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_feedback": bool(cfg.get("norm_output", False)),
    }
    return _canonical_spec(
        "speculators",
        dims,
        taps,
        strip_prefixes(tensors),
        backbone=BACKBONES[mtype],
        ttt_length=as_int(ttt, "speculative_tokens"),
        draft_vocab=as_int(cfg.get("draft_vocab_size", 32000), "draft_vocab_size"),
        extra=extra,
    )


def _translate_specforge(cfg: dict, tensors: dict) -> DrafterSpec:
    mtype = cfg.get("model_type", "llama")
    if mtype != "llama":
        raise CheckpointError(
            f"SpecForge EAGLE-3 drafters with a {mtype!r} layer are not supported (llama only)"
        )
    dims = backbone_fields(cfg)
    _check_target_hidden(cfg, dims["hidden_size"])
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        n_target = cfg.get("num_target_layers")
        if n_target is None:
            raise CheckpointError(
                "SpecForge EAGLE-3 config has no eagle_config.eagle_aux_hidden_state_layer_ids; "
                "its default depends on the target's depth, which the checkpoint does not record"
            )
        ids = [1, n_target // 2 - 1, n_target - 4]  # SpecForge's resolve_eagle_capture_layers
    taps = layer_ids(ids, cfg.get("num_target_layers"))
    renamed = {}
    for name, value in strip_prefixes(tensors).items():
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        renamed[name] = value
    return _canonical_spec(
        "specforge",
        dims,
        taps,
        renamed,
        backbone="llama",
        ttt_length=7,  # SpecForge trains 7 steps by default; the config does not record it
        draft_vocab=as_int(cfg.get("draft_vocab_size") or dims["vocab_size"], "draft_vocab_size"),
        extra={
            "fc_norm": bool(cfg.get("fc_norm", False)),
            "norm_before_head": bool(cfg.get("norm_output", True)),
        },
    )


TRANSLATORS = {
    "deepspec": _translate_deepspec,
    "speculators": _translate_speculators,
    "specforge": _translate_specforge,
}


class Eagle3Format:
    name = "eagle3"
    description = "EAGLE-3 (DeepSpec Qwen3Eagle3Model, speculators eagle3, SpecForge)"
    architectures = tuple(dict.fromkeys(DEEPSPEC_ARCHS + SPECFORGE_ARCHS + SPECULATORS_ARCHS))

    def detect(self, config: dict) -> bool:
        return packaging(config) is not None

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        kind = packaging(checkpoint.config)
        if kind is None:
            raise CheckpointError("not an EAGLE-3 drafter checkpoint")
        return TRANSLATORS[kind](checkpoint.config, checkpoint.tensors)


@hookimpl
def register_drafter_formats(register):
    register(Eagle3Format())
