"""An example third-party outrider plugin: the `flatpack` drafter checkpoint format.

`flatpack` stands for the packagings community trainers invent: the same DSpark drafter as
DeepSpec's, with the drafter's fields in a `flatpack` section of config.json, the backbone's
dimensions in a `backbone` section, and tensors under Megatron-style names
(`decoder.layers.0.self_attention.linear_q.weight` for DeepSpec's
`layers.0.self_attn.q_proj.weight`). A format plugin only translates packaging: it claims the
checkpoint from its config, renames the tensors to outrider's canonical (DeepSpec) names and
returns a `DrafterSpec`; the `dspark` strategy runs it like any other DSpark drafter.

`repack(deepspec_folder, out)` writes a DeepSpec checkpoint in this packaging, which is how the
plugin's test gets a flatpack checkpoint (from `outrider.testing.make_tiny_drafter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from outrider.core.checkpoint import Checkpoint, read_config
from outrider.core.drafter_spec import DrafterSpec
from outrider.core.errors import CheckpointError
from outrider.core.formats import as_int, backbone_fields, layer_ids, require
from outrider.core.hookspecs import hookimpl

ARCHITECTURE = "FlatpackDSparkDrafter"

# flatpack name part -> DeepSpec name part, applied in order to each tensor name.
RENAMES = [
    ("decoder.layers.", "layers."),
    ("self_attention.linear_q.", "self_attn.q_proj."),
    ("self_attention.linear_k.", "self_attn.k_proj."),
    ("self_attention.linear_v.", "self_attn.v_proj."),
    ("self_attention.linear_proj.", "self_attn.o_proj."),
    ("self_attention.q_layernorm.", "self_attn.q_norm."),
    ("self_attention.k_layernorm.", "self_attn.k_norm."),
    ("pre_attention_norm.", "input_layernorm."),
    ("pre_mlp_norm.", "post_attention_layernorm."),
    ("mlp.linear_gate.", "mlp.gate_proj."),
    ("mlp.linear_up.", "mlp.up_proj."),
    ("mlp.linear_down.", "mlp.down_proj."),
    ("decoder.final_norm.", "norm."),
    ("context.projection.", "fc."),
    ("context.norm.", "hidden_norm."),
    ("embedding.", "embed_tokens."),
    ("output_layer.", "lm_head."),
    ("sequential.in_table.", "markov_head.markov_w1."),
    ("sequential.out_proj.", "markov_head.markov_w2."),
    ("confidence.", "confidence_head.proj."),
]

# DeepSpec config fields kept in the flatpack section.
DRAFTER_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
BACKBONE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


def to_deepspec(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def to_flatpack(name: str) -> str:
    for old, new in reversed(RENAMES):
        name = name.replace(new, old)
    return name


class FlatpackFormat:
    name = "flatpack"
    description = "flatpack DSpark (example plugin: DeepSpec's drafter under renamed tensors)"
    architectures = (ARCHITECTURE,)

    def detect(self, config: dict) -> bool:
        return ARCHITECTURE in (config.get("architectures") or [])

    def translate(self, checkpoint: Checkpoint) -> DrafterSpec:
        cfg = checkpoint.config
        section = cfg.get("flatpack")
        backbone = cfg.get("backbone")
        if not isinstance(section, dict) or not isinstance(backbone, dict):
            raise CheckpointError("flatpack config.json needs 'flatpack' and 'backbone' sections")
        rank = as_int(section.get("markov_rank", 0), "markov_rank")
        confidence = bool(section.get("enable_confidence_head", False))
        spec = DrafterSpec(
            format=self.name,
            kind="dspark" if rank > 0 or confidence else "dflash",
            block_size=as_int(require(section, "block_size", "flatpack section"), "block_size"),
            logits_start=0,
            mask_token_id=as_int(
                require(section, "mask_token_id", "flatpack section"), "mask_token_id"
            ),
            target_layer_ids=layer_ids(
                require(section, "target_layer_ids", "flatpack section"),
                section.get("num_target_layers"),
            ),
            markov_rank=rank,
            markov_type=section.get("markov_head_type", "vanilla"),
            confidence_head=confidence,
            confidence_with_markov=confidence
            and bool(section.get("confidence_head_with_markov"))
            and rank > 0,
            **backbone_fields(backbone),
        )
        spec.weights = {to_deepspec(k): v for k, v in checkpoint.tensors.items()}
        return spec


def repack(deepspec: str | Path, out: str | Path) -> Path:
    """Write the DeepSpec DSpark checkpoint in `deepspec` as a flatpack checkpoint in `out`."""
    src, out = Path(deepspec), Path(out)
    cfg = read_config(src)
    tensors: dict[str, mx.array] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(mx.load(str(f)))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), {to_flatpack(k): v for k, v in tensors.items()}
    )
    config = {
        "architectures": [ARCHITECTURE],
        "flatpack": {k: cfg[k] for k in DRAFTER_FIELDS if k in cfg},
        "backbone": {k: cfg[k] for k in BACKBONE_FIELDS if k in cfg},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@hookimpl
def register_drafter_formats(register):
    register(FlatpackFormat())
