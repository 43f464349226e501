"""GGUF targets: a llama.cpp file read into what an mlx-lm model needs (config, weights under
mlx-lm's module names, tokenizer), without executing anything from the file.

The header (metadata, tensor table) is parsed first (`gguf_header.py`), so a damaged or
unsupported file is refused with one line before anything is read. Tensor data is read here, not by MLX's own GGUF
reader (which skips some types without a word and dequantizes Q4_K wrongly in MLX 0.32):
float tensors as stored, quantized ones as MLX affine triples (`gguf_blocks.py`): Q4_0 … Q8_0,
Q4_K and Q5_K keep the file's codes, so the K-quant files most people download (Q4_K_M,
Q5_K_M) run at about their own size; Q6_K is held at 8 bits. The tokenizer is rebuilt from the
metadata (`gguf_tokenizer.py`). Architectures: llama (with experts: Mixtral), qwen2, qwen2moe,
qwen3, qwen3moe, phi3, gemma2 and gemma3.

RoPE: llama.cpp's converter permutes the Q/K rows of `llama` files so that GGML's "normal" RoPE
(adjacent pairs) computes what the Hugging Face model computes with rotate-half. We keep the
file's rows and run MLX's traditional (adjacent-pair) RoPE, the same computation; qwen2/qwen3
files are not permuted and use GGML's NeoX RoPE, i.e. MLX's default. `tests/test_gguf.py` checks
both against the unconverted model. Llama 3.1-3.3 files carry their RoPE scaling as per-pair
factors (`rope_freqs.weight`); it becomes mlx-lm's `llama3` rope_scaling again, checked to
reproduce every stored factor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import CheckpointError
from .gguf_blocks import BITS, BLOCK, GROUP_SIZE, affine_triple
from .gguf_header import Header, read_header
from .gguf_tokenizer import build_tokenizer as tokenizer_from_metadata
from .gguf_tokenizer import check_tokenizer

ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1-style per-dimension RoPE factors

# general.architecture -> (mlx-lm model_type, MLX traditional RoPE). llama.cpp's rope type per
# architecture: LLAMA is "normal" (adjacent pairs, Q/K rows permuted by the converter);
# QWEN2 / QWEN3 are "neox" (rotate-half, rows as in the Hugging Face checkpoint).
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
ARCHITECTURES["qwen3moe"] = ("qwen3_moe", False)  # Qwen3's attention, every layer's MLP experts
# Qwen1.5-MoE / Qwen2-MoE: qwen2's attention; experts beside a shared expert behind a sigmoid gate
ARCHITECTURES["qwen2moe"] = ("qwen2_moe", False)
MIXTRAL = ("mixtral", True)  # a `llama` file with experts: Mixtral's packaging
ARCHITECTURES["phi3"] = ("phi3", False)  # Phi-3 / Phi-4: fused qkv and gate|up projections
# Gemma 2 and 3: sandwich norms stored plus one (llama.cpp's converter folds Gemma's 1 + w in)
ARCHITECTURES["gemma2"] = ("gemma2", False)
ARCHITECTURES["gemma3"] = ("gemma3_text", False)
GEMMAS = ("gemma2", "gemma3_text")
# What llama.cpp's Gemma 3 graph hardcodes (llama-model.cpp, LLM_ARCH_GEMMA3): a global layer
# in every six, local RoPE base 10,000; queries scaled by head_dim^-1/2, by (hidden / heads)^-1/2
# in the 62-layer 27B
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62
GEMMA2_27B_LAYERS = 46  # likewise Gemma 2's 27B (llama.cpp's LLM_ARCH_GEMMA2)
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE
ROPE_TENSORS = (ROPE_FREQS, *LONGROPE)  # RoPE factors: read into the config, not weights
MOE_MODELS = ("qwen3_moe", "qwen2_moe", "mixtral")
# mlx-lm models whose head size is hidden // heads
HEAD_FROM_WIDTH = ("phi3", "mixtral", "qwen2_moe")

# Tensor types read as stored; the quantized ones become MLX affine triples (gguf_blocks.py).
PLAIN_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
QUANT_BITS = BITS
READABLE = sorted(PLAIN_TYPES) + sorted(QUANT_BITS)

# llama.cpp tensor names -> mlx-lm module names (per block: blk.N.<key>).
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v in one
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",  # the norm before the MLP (Gemma 3: see below)
    "post_attention_norm": "post_attention_layernorm",  # Gemma 3's sandwich norms
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, and each projection of every expert in one 3-D tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    # qwen2moe's shared expert, and the gate (one row) that scales its output by a sigmoid
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
SHARED_GATE = "ffn_gate_inp_shexp"  # llama.cpp declares it [n_embd]: a file may hold it 1-D


def model_type(header: Header) -> tuple[str, bool]:
    """(mlx-lm model_type, traditional RoPE) of the file: by its architecture, where a `llama`
    file with experts (a router per layer) is Mixtral."""
    if header.arch == "llama" and "blk.0.ffn_gate_inp.weight" in header.tensors:
        return MIXTRAL
    return ARCHITECTURES[header.arch]


def _module_name(tensor: str, model: str = "") -> str | None:
    """The mlx-lm module path of a llama.cpp tensor name (without .weight/.bias), or None.
    mlx-lm's Mixtral keeps its experts under `block_sparse_moe`, not `mlp`."""
    base = tensor.rsplit(".", 1)[0]
    if base in GLOBAL_NAMES:
        return GLOBAL_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        inner = BLOCK_NAMES[parts[2]]
        if model == "phi3" and parts[2] == "ffn_up":  # phi3's ffn_up is [gate; up], fused
            inner = "mlp.gate_up_proj"
        if model in GEMMAS and parts[2] == "ffn_norm":  # Gemma's pre-MLP norm
            inner = "pre_feedforward_layernorm"
        if model == "mixtral" and inner.startswith("mlp."):
            inner = "block_sparse_moe." + inner.removeprefix("mlp.")
        return f"model.layers.{parts[1]}.{inner}"
    return None


def check(header: Header) -> None:
    """Refuse, by name, what this reader cannot run faithfully."""
    name = header.path.name
    if header.arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{name}: GGUF architecture {header.arch or '(none)'!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    experts = model_type(header)[0] in MOE_MODELS
    for t in header.tensors.values():
        if t.type not in PLAIN_TYPES and t.type not in QUANT_BITS:
            raise CheckpointError(
                f"{name}: tensor {t.name!r} has type {t.type}, which outrider cannot read "
                f"faithfully (readable: {', '.join(READABLE)})"
            )
        if t.type in QUANT_BITS:
            block = BLOCK[t.type][0]
            cols = t.shape[-1] if t.shape else 0
            if cols <= 0 or cols % block:
                raise CheckpointError(
                    f"{name}: tensor {t.name!r} is {t.type}, whose rows hold whole blocks of "
                    f"{block} weights, but its rows have {cols}"
                )
        if t.name in ROPE_TENSORS:
            continue
        if ".ffn_gate_inp." in t.name and not experts:
            raise CheckpointError(
                f"{name}: a {header.arch} file with experts (tensor {t.name!r}) is not supported "
                "(experts: qwen2moe, qwen3moe, and llama files as Mixtral)"
            )
        if _module_name(t.name) is None or not t.name.endswith((".weight", ".bias")):
            raise CheckpointError(
                f"{name}: tensor {t.name!r} has no place in a {header.arch} model"
            )
    if "token_embd.weight" not in header.tensors:
        raise CheckpointError(f"{name} has no token_embd.weight tensor")
    check_tokenizer(header.metadata, name)


def _int(header: Header, key: str, default: int | None = None) -> int:
    value = header.get(key, default)
    if value is None:
        raise CheckpointError(f"{header.path.name} has no {header.arch}.{key} in its metadata")
    if isinstance(value, np.ndarray):  # per-layer values: fine only when all equal
        if value.size == 0 or (value != value.flat[0]).any():
            raise CheckpointError(f"{header.path.name}: per-layer {key} values are not supported")
        value = value.flat[0]
    return int(value)


# Llama 3.1's RoPE scaling, the one llama.cpp stores as per-dimension factors: everything but
# the factor is the same in every Llama 3.x release (their config.json rope_scaling).
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_SCALING["original_max_position_embeddings"] = 8192


def llama3_factors(scaling: dict, head_dim: int, base: float) -> np.ndarray:
    """Per rotated pair, the factor its wavelength is stretched by under Llama 3's scaling, as
    llama.cpp's converter writes them (`rope_freqs.weight`): 1 for short wavelengths, `factor`
    for long ones, a smooth blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blend))


def rope_factors(header: Header, tensor: str, pairs: int) -> np.ndarray:
    """A tensor of per-pair RoPE factors (float64), checked to be F32 with one per pair."""
    info = header.tensors[tensor]
    if info.type != "F32" or info.shape != (pairs,):
        raise CheckpointError(
            f"{header.path.name}: {tensor} is {info.type} {list(info.shape)}; expected F32 "
            f"[{pairs}], one factor per rotated pair"
        )
    return np.fromfile(header.path, "<f4", pairs, offset=info.offset).astype(np.float64)


def llama3_scaling(header: Header, head_dim: int, base: float) -> dict:
    """mlx-lm's `rope_scaling` for a file's `rope_freqs.weight`: Llama 3's scaling with the
    factor the tensor shows, provided it reproduces every stored factor; refused otherwise."""
    name = header.path.name
    stored = rope_factors(header, ROPE_FREQS, head_dim // 2)
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), **LLAMA3_SCALING}
    if not np.all(np.isfinite(stored)) or not np.allclose(
        llama3_factors(scaling, head_dim, base), stored, rtol=1e-5, atol=0
    ):
        raise CheckpointError(
            f"{name}: rope_freqs.weight holds per-dimension RoPE factors that are not Llama 3's "
            f"scaling (factor {scaling['factor']:g}, low 1, high 4, original context 8192); "
            "other factors are not supported"
        )
    return scaling


def expert_counts(header: Header) -> tuple[int, int]:
    """(experts a layer routes among, experts each token uses), checked."""
    experts, used = _int(header, "expert_count"), _int(header, "expert_used_count")
    if not 0 < used <= experts:
        raise CheckpointError(
            f"{header.path.name}: {used} experts used of {experts}; expected 1 to {experts}"
        )
    return experts, used


def phi3_fields(header: Header, head_dim: int, rotated: int) -> dict:
    """mlx-lm's phi3 fields: the share of each head RoPE turns and, where the file carries
    LongRoPE's per-pair factors (Phi-3 128k, Phi-3.5), that scaling with its original context."""
    fields: dict = {"partial_rotary_factor": rotated / head_dim}
    present = [t for t in LONGROPE if t in header.tensors]
    if not present:
        return fields
    if len(present) < len(LONGROPE):
        raise CheckpointError(f"{header.path.name}: LongRoPE needs {' and '.join(LONGROPE)}")
    long, short = (rope_factors(header, t, rotated // 2).tolist() for t in LONGROPE)
    fields["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    fields["original_max_position_embeddings"] = _int(
        header, "rope.scaling.original_context_length"
    )
    return fields


def _gemma_query_scale(header: Header, hidden: int, heads: int, head_dim: int, big: int) -> int:
    """`query_pre_attn_scalar` as llama.cpp's Gemma graphs take it: head_dim, but hidden/heads
    in the 27B, which they recognise by its layer count (`big`)."""
    return hidden // heads if _int(header, "block_count") == big else head_dim


def gemma3_fields(header: Header, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3's sliding windows and query scale: the window from the file, the rest as
    llama.cpp's graph hardcodes it (a file's own `final_logit_softcapping`, which mlx-lm's
    gemma3_text does not apply, is refused)."""
    if header.get("final_logit_softcapping") is not None:
        raise CheckpointError(
            f"{header.path.name}: a Gemma 3 file with final logit soft-capping is not supported"
        )
    return {
        "sliding_window": _int(header, "attention.sliding_window"),
        "sliding_window_pattern": GEMMA3_PATTERN,
        "rope_local_base_freq": GEMMA3_LOCAL_BASE,
        "query_pre_attn_scalar": _gemma_query_scale(
            header, hidden, heads, head_dim, GEMMA3_27B_LAYERS
        ),
    }


def gemma2_fields(header: Header, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 2's soft-capping from the file and its query scale as llama.cpp's graph takes it.
    mlx-lm's gemma2 slides no window: past `attention.sliding_window` (4,096) it parts from
    llama.cpp, as mlx-lm does from the reference model (docs/families.md)."""
    return {
        "attn_logit_softcapping": float(header.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(header.get("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _gemma_query_scale(
            header, hidden, heads, head_dim, GEMMA2_27B_LAYERS
        ),
    }


def read_config(path: Path) -> dict:
    """An mlx-lm config (config.json's fields) from the file's metadata."""
    header = read_header(path)
    check(header)
    arch, meta, tensors = header.arch, header.metadata, header.tensors
    model, traditional = model_type(header)
    hidden = _int(header, "embedding_length")
    heads = _int(header, "attention.head_count")
    head_dim = _int(header, "attention.key_length", hidden // heads)
    if _int(header, "attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{path.name}: key and value head sizes differ")
    rotated = _int(header, "rope.dimension_count", head_dim)
    if rotated != head_dim and model != "phi3":
        raise CheckpointError(f"{path.name}: partial RoPE (rope.dimension_count) is not supported")
    scaling = header.get("rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": float(header.get("rope.scaling.factor"))}
    elif scaling != "none":
        raise CheckpointError(f"{path.name}: RoPE scaling {scaling!r} is not supported yet")
    if ROPE_FREQS in tensors:
        if rope_scaling is not None:
            raise CheckpointError(f"{path.name} has both rope_freqs.weight and {scaling} scaling")
        base = float(header.get("rope.freq_base", 10000.0))
        rope_scaling = llama3_scaling(header, head_dim, base)
    vocab = tensors["token_embd.weight"].shape[0]
    config = {
        "model_type": model,
        "architectures": [f"GGUF:{arch}"],
        "hidden_size": hidden,
        "num_hidden_layers": _int(header, "block_count"),
        # a MoE file may leave the dense width out (no layer of it is dense)
        "intermediate_size": _int(
            header, "feed_forward_length", header.get("expert_feed_forward_length")
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(header, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(header.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(header.get("rope.freq_base", 10000.0)),
        "rope_traditional": traditional,
        "rope_scaling": rope_scaling,
        "vocab_size": vocab,
        "max_position_embeddings": _int(header, "context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
    }
    if model in HEAD_FROM_WIDTH and head_dim != hidden // heads:
        raise CheckpointError(
            f"{path.name}: heads of {head_dim} in a {hidden}-wide model; mlx-lm's {model} "
            f"takes {hidden // heads}"
        )
    if model == "phi3":
        config.update(phi3_fields(header, head_dim, rotated))
    elif model == "qwen3_moe":  # llama.cpp's qwen3moe graph renormalises the chosen experts
        experts, used = expert_counts(header)
        config.update(
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=_int(header, "expert_feed_forward_length"),
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    elif model == "qwen2_moe":  # llama.cpp's qwen2moe graph keeps the softmax weights as they are
        experts, used = expert_counts(header)
        config.update(
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=_int(header, "expert_feed_forward_length"),
            shared_expert_intermediate_size=_int(header, "expert_shared_feed_forward_length"),
        )
    elif model == "gemma3_text":
        config.update(gemma3_fields(header, hidden, heads, head_dim))
    elif model == "gemma2":
        config.update(gemma2_fields(header, hidden, heads, head_dim))
    elif model == "mixtral":  # experts as wide as the file's feed_forward_length
        config["num_local_experts"], config["num_experts_per_tok"] = expert_counts(header)
    for key in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    quant = {
        _module_name(t.name, model): {"group_size": GROUP_SIZE, "bits": QUANT_BITS[t.type]}
        for t in tensors.values()
        if t.type in QUANT_BITS
    }
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.type] = types.get(t.type, 0) + 1
    if quant:  # mlx-lm's layout: the commonest setting on top, every quantized module named
        common = max((t for t in types if t in QUANT_BITS), key=types.__getitem__)
        top = {"group_size": GROUP_SIZE, "bits": QUANT_BITS[common], "mode": "affine"}
        config["quantization"] = {**top, **quant}
    config["gguf"] = {"file": path.name, "tensor_types": types}
    return config


def loaded_bytes(path: Path) -> int:
    """What the file's weights take once loaded: float tensors as stored, quantized ones at
    their MLX bits plus a float16 scale and bias per 32 weights (Q6_K at 8 bits, a K-quant's
    6-bit scales as two float16s: more than the file holds)."""
    total = 0
    for t in read_header(path).tensors.values():
        if t.name in ROPE_TENSORS:
            continue
        count = int(np.prod(t.shape)) if t.shape else 1
        if t.type in QUANT_BITS:
            total += count * QUANT_BITS[t.type] // 8 + count // GROUP_SIZE * 4
        else:
            total += t.nbytes
    return total


def read_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor under its mlx-lm name; quantized ones as MLX affine triples (group 32)."""
    header = read_header(path)
    check(header)
    try:
        data = np.memmap(path, np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name} could not be read ({e})") from None
    weights = {}
    model = model_type(header)[0]
    for tname, info in header.tensors.items():
        if tname in ROPE_TENSORS:
            continue
        base, kind = _module_name(tname, model), tname.rsplit(".", 1)[1]
        raw = data[info.offset : info.offset + info.nbytes]
        if len(raw) != info.nbytes:  # the file shrank since its header was read
            raise CheckpointError(f"{path.name} is truncated: tensor {tname!r} runs past its end")
        if info.type in QUANT_BITS:
            w, scales, biases = affine_triple(info.type, raw, info.shape, f"{path.name}: {tname!r}")
            weights[f"{base}.scales"], weights[f"{base}.biases"] = scales, biases
            weights[f"{base}.{kind}"] = w
            continue
        array = mx.array(np.array(raw.view(PLAIN_TYPES[info.type]).reshape(info.shape)))
        if info.type == "BF16":  # the bits as stored (numpy has no bfloat16)
            array = array.view(mx.bfloat16)
        if model in GEMMAS and tname.endswith("norm.weight"):
            array = array - 1  # mlx-lm's Gemma norms multiply by 1 + w, as the checkpoint
        if f".{SHARED_GATE}." in tname and array.ndim == 1:
            array = array[None]  # mlx-lm's shared-expert gate: a Linear of one output row
        weights[f"{base}.{kind}"] = array
    return weights


def build_tokenizer(path: Path) -> Any:
    """The file's tokenizer (`gguf_tokenizer.py`), in mlx-lm's wrapper."""
    header = read_header(path)
    check(header)
    return tokenizer_from_metadata(header.metadata, path.name)


def build_model(path: Path, config: dict | None = None) -> nn.Module:
    """The mlx-lm model class of the file's architecture, quantized per tensor as stored."""
    from mlx_lm.utils import _get_classes

    config = config or read_config(path)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    quant = {k: v for k, v in (config.get("quantization") or {}).items() if isinstance(v, dict)}
    if quant:
        nn.quantize(model, class_predicate=lambda p, _: quant.get(p, False))
    weights = read_weights(path)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def load(path: Path, config: dict | None = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of a GGUF target."""
    config = config or read_config(path)
    return build_model(path, config), build_tokenizer(path)
