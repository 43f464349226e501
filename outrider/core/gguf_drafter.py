"""DSpark drafters shipped as GGUF (PrismML's `*-dspark-bf16.gguf`), converted once into
DeepSpec's safetensors layout in outrider's cache, then loaded like any DeepSpec drafter.

The file is parsed, never executed: outrider's bounds-checked header reader
(`outrider.core.gguf_header.read_header`) refuses a truncated or foreign file before any tensor data is
touched, and gguf-py's `GGUFReader` (llama.cpp's own reader) hands the tensor data back as
NumPy views. Quantized tensors (a Q8_0 or Q4_K repack, say) are dequantized to float32 by
gguf-py; the drafter is quantized again at `--drafter-bits` when it loads, as any drafter is. Metadata keys and tensor names follow PrismML's converter as inverted by
ARahim3/mlx-dspark `src/mlx_dspark/gguf_convert.py`; the target layout is DeepSpec's
(deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/config.py`, `.../modeling.py`). GGUF lists
dimensions fastest-first, so every shape is reversed back to row-major.

Bonsai drafters add GIDD log-SNR conditioning: a constant per-slot vector on the block's input
embeddings, `fc2(silu(fc1(features(t))))`, with the anchor slot at max log-SNR and every mask slot
at min (ARahim3/mlx-dspark `src/mlx_dspark/model.py` `log_snr_features`, `LogSnrEmbed`, after
PrismML's dspark.cpp). Since the block is always [anchor, mask, ...], the vector is folded into
the embedding table at conversion: every row gains the anchor's vector, the mask row the masks'.
The result is a plain DeepSpec drafter. (Only an anchor equal to the mask id, a token the
tokenizer never produces, would embed differently; drafts only, never the output.)

The cache entry is named by the sha256 of the file's bytes: a second run finds it, a changed
file gets a new entry. The hash of a (path, size, mtime) is remembered beside the entries so a
second run does not read the whole file again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .checkpoint import Checkpoint
from .errors import CheckpointError
from .gguf import ARCHITECTURES, BLOCK_NAMES
from .gguf_header import read_header
from .paths import cache_root

ARCHITECTURE = "dspark"
PLAIN_TYPES = ("F32", "F16")  # as stored; BF16 from its bits; the rest dequantized
# Bumped when the conversion's output changes, so old cache entries are not reused.
CONVERTER_VERSION = 2

# PrismML tensor name -> DeepSpec tensor name (global tensors).
GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "norm.weight",
    "dspark.fc.weight": "fc.weight",
    "dspark.hidden_norm.weight": "hidden_norm.weight",
    "dspark.markov_head_a.weight": "markov_head.markov_w1.weight",
    "dspark.markov_head_b.weight": "markov_head.markov_w2.weight",
    "dspark.confidence_head.weight": "confidence_head.proj.weight",
    "dspark.confidence_head.bias": "confidence_head.proj.bias",
}
# Per layer: blk.{i}.<key>.weight -> layers.{i}.<value>.weight (llama.cpp's block names, as
# a target GGUF's: the drafter's layers are dense Qwen3 decoder layers, no experts)
QWEN3_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm")
QWEN3_LAYER += ("attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NAMES = {key: BLOCK_NAMES[key] for key in QWEN3_LAYER}
LOG_SNR_TENSORS = tuple(f"dspark.log_snr_fc{i}.{k}" for i in (1, 2) for k in ("weight", "bias"))
LOG_SNR_FEATURES = 128  # sinusoidal features of the conditioning MLP's input


def deepspec_name(name: str) -> str | None:
    """The DeepSpec tensor name of a PrismML DSpark GGUF tensor, or None if it has none."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _scalar(value):
    """A metadata value as a plain Python value (arrays as lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def deepspec_config(metadata: dict, vocab_size: int, source: str) -> dict:
    """DeepSpec's config.json from the `dspark.*` metadata (key names per PrismML's converter)."""

    def need(key: str):
        if key not in metadata:
            raise CheckpointError(f"{source}: DSpark GGUF lacks the metadata key {key!r}")
        return _scalar(metadata[key])

    def number(key: str, cast: type, default=None):
        value = need(key) if default is None else _scalar(metadata.get(key, default))
        if isinstance(value, (list, str)) or value is None:
            raise CheckpointError(f"{source}: GGUF metadata {key!r} is not a number ({value!r})")
        return cast(value)

    hidden = number("dspark.embedding_length", int)
    heads = number("dspark.attention.head_count", int)
    rank = number("dspark.dspark.markov_rank", int, 0)
    confidence = bool(_scalar(metadata.get("dspark.dspark.confidence_head", False)))
    layers = number("dspark.block_count", int)
    taps = need("dspark.dspark.target_layers")
    if not isinstance(taps, list):
        raise CheckpointError(f"{source}: GGUF metadata 'dspark.dspark.target_layers' is no list")
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": number("dspark.feed_forward_length", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": number("dspark.attention.head_count_kv", int, heads),
        "head_dim": number("dspark.attention.key_length", int, hidden // max(heads, 1)),
        "rms_norm_eps": number("dspark.attention.layer_norm_rms_epsilon", float, 1e-6),
        "vocab_size": vocab_size,
        "max_position_embeddings": number("dspark.context_length", int, 32768),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": number("dspark.rope.freq_base", float, 1_000_000.0),
        },
        "layer_types": ["full_attention"] * layers,
        "block_size": number("dspark.dspark.block_size", int),
        "mask_token_id": number("dspark.dspark.mask_token_id", int),
        "target_layer_ids": [int(t) for t in taps],
        "markov_rank": rank,
        "enable_confidence_head": confidence,
        "tie_word_embeddings": False,
    }
    if rank > 0:
        config["markov_head_type"] = "vanilla"  # the GGUF names only W1 / W2 (no gate, no rnn)
    if confidence:
        config["confidence_head_with_markov"] = bool(
            _scalar(metadata.get("dspark.dspark.confidence_head_with_markov", False))
        )
    return config


def _tensor_array(tensor, file: str) -> mx.array:
    """One GGUFReader tensor as an MLX array, row-major: float tensors in their stored dtype,
    quantized ones dequantized to float32 by gguf-py (llama.cpp's reference dequantization;
    the drafter is quantized again at --drafter-bits when it loads)."""
    import gguf

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    kind = tensor.tensor_type.name
    if kind == "BF16":  # gguf-py hands BF16 back as raw bytes
        return mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    if kind in PLAIN_TYPES:
        return mx.array(data.reshape(shape))
    try:
        values = gguf.quants.dequantize(data, tensor.tensor_type)
    except (NotImplementedError, ValueError):  # a type it lacks, rows of no whole block
        raise CheckpointError(
            f"{file}: tensor {tensor.name!r} is stored as {kind} {list(shape)}, which llama.cpp's "
            "reference reader (gguf-py) cannot dequantize"
        ) from None
    return mx.array(values.reshape(shape))


def read_gguf_checkpoint(path: Path) -> Checkpoint:
    """A PrismML DSpark GGUF as a DeepSpec checkpoint in memory (config + tensors), or
    CheckpointError naming what is wrong: not a GGUF, truncated, not a DSpark drafter, a tensor
    type gguf-py cannot dequantize, an unknown or missing tensor or metadata key. Log-SNR
    conditioning is folded into the embedding table (see the module's docstring)."""
    import gguf  # gguf-py, llama.cpp's reader

    path = Path(path)
    name = path.name
    header = read_header(path)  # magic, version, every tensor inside the file: one-line refusals
    arch = header.arch
    if arch != ARCHITECTURE:
        if arch in ARCHITECTURES:
            raise CheckpointError(
                f"{name} is a {arch} model GGUF, not a drafter; pass it as --model "
                "(--drafter takes a DSpark drafter GGUF, general.architecture 'dspark')"
            )
        raise CheckpointError(
            f"{name}: GGUF architecture {arch or '(none)'!r} is not a DSpark drafter "
            "(expected general.architecture 'dspark')"
        )
    metadata = header.metadata
    log_snr = bool(_scalar(metadata.get("dspark.dspark.log_snr_conditioning", False)))
    if not log_snr and any(t in LOG_SNR_TENSORS for t in header.tensors):
        raise CheckpointError(
            f"{name} carries log-SNR tensors (dspark.log_snr_fc*) but its metadata does not "
            "set dspark.dspark.log_snr_conditioning"
        )
    unknown = sorted(
        t for t in header.tensors if deepspec_name(t) is None and t not in LOG_SNR_TENSORS
    )
    if unknown:
        raise CheckpointError(f"{name}: unknown DSpark GGUF tensor {unknown[0]!r}")
    embed = header.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise CheckpointError(f"{name}: DSpark GGUF lacks the tensor 'token_embd.weight'")
    config = deepspec_config(metadata, embed.shape[0], name)
    wanted = expected_gguf_tensors(config) + (list(LOG_SNR_TENSORS) if log_snr else [])
    missing = [t for t in wanted if t not in header.tensors]
    if missing:
        raise CheckpointError(f"{name}: DSpark GGUF lacks the tensor {missing[0]!r}")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError) as e:
        raise CheckpointError(f"{name} is not a readable GGUF file ({e})") from None
    arrays = {t.name: _tensor_array(t, name) for t in reader.tensors}
    tensors = {deepspec_name(n): a for n, a in arrays.items() if n not in LOG_SNR_TENSORS}
    if log_snr:
        low = float(_number(metadata, "dspark.dspark.min_log_snr", name))
        high = float(_number(metadata, "dspark.dspark.max_log_snr", name))
        if not high > low:
            raise CheckpointError(f"{name}: log-SNR range [{low}, {high}] is empty")
        mlp = [arrays[t] for t in LOG_SNR_TENSORS]
        tensors["embed_tokens.weight"] = fold_log_snr(
            tensors["embed_tokens.weight"], config["mask_token_id"], mlp, low, high, name
        )
        config["log_snr_folded_into_embeddings"] = {"min_log_snr": low, "max_log_snr": high}
    return Checkpoint(path, config, tensors)


def _number(metadata: dict, key: str, source: str) -> float:
    value = _scalar(metadata.get(key))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{source}: GGUF metadata {key!r} is missing or not a number")
    return value


def log_snr_features(log_snr: mx.array, low: float, high: float) -> mx.array:
    """[n, 128] features: t = (snr - min) / (max - min) * 1000, then [sin(t f_i), cos(t f_i)]
    with f_i = 10000^(-i/64), the sine half first."""
    half = LOG_SNR_FEATURES // 2
    t = (log_snr.astype(mx.float32) - low) / (high - low) * 1000.0
    freq = mx.exp(-np.log(10000.0) * mx.arange(half, dtype=mx.float32) / half)
    angle = t[:, None] * freq[None, :]
    return mx.concatenate([mx.sin(angle), mx.cos(angle)], axis=-1)


def fold_log_snr(
    embed: mx.array, mask_id: int, mlp: list[mx.array], low: float, high: float, source: str
) -> mx.array:
    """The embedding table with the anchor slot's log-SNR vector on every row and the mask
    slots' vector on the mask row instead, computed in the table's dtype."""
    w1, b1, w2, b2 = (a.astype(embed.dtype) for a in mlp)
    hidden = embed.shape[1]
    shapes = [tuple(a.shape) for a in (w1, b1, w2, b2)]
    if shapes != [(hidden, LOG_SNR_FEATURES), (hidden,), (hidden, hidden), (hidden,)]:
        raise CheckpointError(
            f"{source}: log-SNR MLP shapes {shapes} do not fit hidden size {hidden} "
            f"({LOG_SNR_FEATURES} features)"
        )
    if not 0 <= mask_id < embed.shape[0]:
        raise CheckpointError(f"{source}: mask_token_id {mask_id} is outside the vocabulary")
    feats = log_snr_features(mx.array([high, low]), low, high).astype(embed.dtype)
    anchor, masked = nn.silu(feats @ w1.T + b1) @ w2.T + b2
    rows = mx.arange(embed.shape[0])[:, None]
    return mx.where(rows == mask_id, embed + masked, embed + anchor)


def expected_gguf_tensors(config: dict) -> list[str]:
    """The GGUF tensors a DSpark drafter of this config must carry."""
    names = ["token_embd.weight", "output.weight", "output_norm.weight"]
    names += ["dspark.fc.weight", "dspark.hidden_norm.weight"]
    for i in range(config["num_hidden_layers"]):
        names += [f"blk.{i}.{key}.weight" for key in LAYER_NAMES]
    if config["markov_rank"] > 0:
        names += ["dspark.markov_head_a.weight", "dspark.markov_head_b.weight"]
    if config["enable_confidence_head"]:
        names += ["dspark.confidence_head.weight", "dspark.confidence_head.bias"]
    return names


def check_loadable(checkpoint: Checkpoint) -> None:
    """Translate and build the drafter once, so a damaged one is refused before it is written
    (wrong shapes, say), with the message a run would give."""
    from ..plugins.formats.deepspec import DeepSpecFormat
    from ..plugins.strategies.block_drafter import load_block_drafter

    spec = DeepSpecFormat().translate(checkpoint)
    load_block_drafter(dataclasses.replace(spec, weights=dict(spec.weights)), bits=16)


def write_deepspec_folder(folder: Path, config: dict, weights: dict[str, mx.array]) -> None:
    """config.json and model.safetensors (DeepSpec's layout) into an existing folder."""
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def publish_atomically(dest: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` on a fresh sibling folder, then rename it to `dest` in one step, so a
    crash or a concurrent run never leaves a half-written `dest`. An existing `dest` wins."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # not another run's finished copy: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def cache_dir() -> Path:
    """Converted GGUF drafters: drafters/gguf/ under outrider's own cache folder."""
    return cache_root() / "drafters" / "gguf"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hash(path: Path, cache: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime) so a second run skips reading it."""
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = cache / "hashes" / (hashlib.sha256(str(path.resolve()).encode()).hexdigest() + ".json")
    try:
        seen = json.loads(memo.read_text())
        if {k: seen.get(k) for k in stamp} == stamp and isinstance(seen.get("sha256"), str):
            return seen["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = file_sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**stamp, "sha256": digest, "path": str(path)}))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs the next run a re-hash
    return digest


def converted_drafter(path: Path, cache: Path | None = None) -> tuple[Path, bool]:
    """(DeepSpec folder for this DSpark GGUF, whether it was converted now). The folder is
    `<cache>/<sha256 of the file>`; an existing one is reused as is."""
    path = Path(path)
    cache = cache or cache_dir()
    key = content_hash(path, cache)
    dest = cache / f"{key[:32]}-v{CONVERTER_VERSION}"
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest, False
    if dest.exists():  # emptied by hand, say: convert again
        shutil.rmtree(dest)
    checkpoint = read_gguf_checkpoint(path)
    check_loadable(checkpoint)
    config = dict(checkpoint.config, converted_from=path.name, source_sha256=key)

    def write(tmp: Path) -> None:
        write_deepspec_folder(tmp, config, checkpoint.tensors)

    return publish_atomically(dest, write), True
