"""Tiny DSpark drafters written as PrismML ships them: one `.gguf` file, general.architecture
"dspark", the `dspark.*` metadata keys and llama.cpp-style tensor names of PrismML's converter
(as read back by ARahim3/mlx-dspark `src/mlx_dspark/gguf_convert.py`), 2-D weights in BF16 and
norms / biases in F32 (the `-bf16` file).

The weights are those `write_deepspec_block` writes for the same target, seed and overrides, so
one drafter can be compared across the two packagings.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..core.gguf_drafter import GLOBAL_NAMES, LAYER_NAMES
from .drafters import (
    random_block_drafter,
    target_embedding_and_head,
)
from .gguf import random_blocks

_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()}
_LAYER_TO_GGUF = {v: k for k, v in LAYER_NAMES.items()}


def gguf_tensor_name(name: str) -> str:
    """PrismML's GGUF name for a DeepSpec tensor name."""
    if name in _TO_GGUF:
        return _TO_GGUF[name]
    _, layer, rest = name.split(".", 2)  # layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{kind}"


def write_prismml_dspark(
    path: Path,
    target: Path,
    kind: str,
    seed: int = 1,
    *,
    quant: str = "BF16",
    types: dict[str, str] | None = None,
    architecture: str = "dspark",
    drop: tuple[str, ...] = (),
    log_snr: bool = False,
    metadata: dict | None = None,
    **overrides,
) -> Path:
    """Write a DSpark drafter GGUF; `path` is the file (a `.gguf` name) or a folder to hold
    `tiny-dspark-bf16.gguf`. Returns the file.

    `quant` is the GGML type of every 2-D weight (F32, F16, BF16, or a quantized type such as
    Q8_0 to test refusals); `types` overrides it per GGUF tensor name. `architecture` overrides
    general.architecture, `drop` leaves GGUF tensors out, `log_snr` adds Bonsai's GIDD
    conditioning (metadata and `dspark.log_snr_fc1/fc2`), `metadata` replaces metadata values
    (None drops a key). Other overrides reach `block_spec`.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    path = Path(path)
    if path.suffix.lower() != ".gguf":
        path = path / "tiny-dspark-bf16.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    tcfg, spec, weights = random_block_drafter(
        target, kind, seed, logits_start=0, own_embedding=True, own_lm_head=True,
        format="deepspec", **overrides,
    )  # fmt: skip
    weights["embed_tokens.weight"], weights["lm_head.weight"] = target_embedding_and_head(target)

    h = spec.hidden_size
    meta = {
        "general.name": "tiny dspark drafter",
        "dspark.context_length": tcfg.get("max_position_embeddings", 4096),
        "dspark.embedding_length": h,
        "dspark.feed_forward_length": spec.intermediate_size,
        "dspark.block_count": spec.num_layers,
        "dspark.attention.head_count": spec.num_heads,
        "dspark.attention.head_count_kv": spec.num_kv_heads,
        "dspark.attention.key_length": spec.head_dim,
        "dspark.attention.value_length": spec.head_dim,
        "dspark.attention.layer_norm_rms_epsilon": float(spec.rms_norm_eps),
        "dspark.rope.freq_base": float(spec.rope_theta),
        "dspark.dspark.block_size": spec.block_size,
        "dspark.dspark.mask_token_id": spec.mask_token_id,
        "dspark.dspark.target_layers": list(spec.target_layer_ids),
        "dspark.dspark.markov_rank": spec.markov_rank,
        "dspark.dspark.confidence_head": spec.confidence_head,
        "dspark.dspark.confidence_head_with_markov": spec.confidence_with_markov,
        "dspark.dspark.log_snr_conditioning": bool(log_snr),
    }
    tensors = {gguf_tensor_name(n): np.array(v.astype(mx.float32)) for n, v in weights.items()}
    if log_snr:
        meta["dspark.dspark.min_log_snr"], meta["dspark.dspark.max_log_snr"] = -9.0, 9.0
        rng = np.random.default_rng(seed)
        for i, cols in ((1, 128), (2, h)):
            tensors[f"dspark.log_snr_fc{i}.weight"] = rng.normal(0, 0.3, (h, cols))
            tensors[f"dspark.log_snr_fc{i}.bias"] = rng.normal(0, 0.1, (h,))
    meta.update(metadata or {})

    w = gguf.GGUFWriter(str(path), architecture)
    for key, value in meta.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name in sorted(tensors):
        if name in drop:
            continue
        arr = tensors[name].astype(np.float32)
        qtype = Q[(types or {}).get(name, quant if arr.ndim == 2 else "F32")]
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(arr, qtype)
            except (NotImplementedError, gguf.quants.QuantError):  # K-quants, Q8_1: random
                data = random_blocks(qtype.name, arr.shape)
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
