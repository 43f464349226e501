"""Will it fit: an estimate of the memory a target/drafter pair needs, against this machine's.

The estimate is target weights + the KV cache at the context window + drafter weights:

- weights come from safetensors headers (each tensor's byte range; the first 8 bytes of a
  file give the header's length, then its JSON), read from local files when the model is on
  this machine and from the Hub (`HfApi.get_safetensors_metadata`, which reads only headers)
  when asked to go online; a GGUF counts its file size;
- the KV cache is 2 (keys, values) x attention layers x KV heads x head dim x tokens x bytes
  per value (2, or 4 for float32 models; with `--kv-bits` the bits plus a scale and a bias per
  group of 64), from config.json. Hybrids count only their attention
  layers (linear attention and Mamba layers keep a small fixed state), sliding-window layers
  only their window, layers that share another layer's cache nothing.

It is an estimate: activations, the prefill's scratch memory, a vision tower's work and the
operating system's own share are not in it. Nothing here touches the network unless a caller
asks (`online=True`), which outrider does only when a download is about to happen anyway, or
for `outrider models --online`.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError

# Bytes per element of each safetensors dtype (used when a header has no byte offsets).
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header


@dataclass
class Estimate:
    """Bytes a pair needs (None where unknown) and what this machine has."""

    weights: int | None = None  # the target's weights
    kv_cache: int | None = None  # the target's KV cache at `window` tokens
    window: int | None = None
    drafter: int | None = None  # the drafter's weights (None: no drafter, or unknown)
    memory: int | None = None  # what this machine offers a model
    memory_source: str = ""

    @property
    def total(self) -> int | None:
        if self.weights is None:
            return None
        return self.weights + (self.kv_cache or 0) + (self.drafter or 0)

    @property
    def fits(self) -> bool | None:
        """True / False, or None when the weights (or the machine's memory) are unknown."""
        total = self.total
        if total is None or not self.memory:
            return None
        return total <= self.memory

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "fits": self.fits}

    def summary(self) -> str:
        """'16.4 GB weights + 6.0 GB KV cache at 40,960 tokens + 0.5 GB drafter = 22.9 GB'"""
        parts = [f"{gb(self.weights)} weights"]
        if self.kv_cache is not None:
            parts.append(f"{gb(self.kv_cache)} KV cache at {self.window:,} tokens")
        if self.drafter is not None:
            parts.append(f"{gb(self.drafter)} drafter")
        return " + ".join(parts) + (f" = {gb(self.total)}" if len(parts) > 1 else "")


def gb(n: int | None) -> str:
    """Bytes as GB (MB below 1 GB, so a tiny model does not read 0.0 GB)."""
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# --- the machine -------------------------------------------------------------------------------


def machine_memory() -> tuple[int | None, str]:
    """(bytes, what they are): Metal's recommended working set where MLX runs on a GPU that
    reports one, else the device's memory, else this machine's RAM (`os.sysconf`)."""
    info: dict[str, Any] = {}
    try:
        import mlx.core as mx

        getter = getattr(mx, "device_info", None) or mx.metal.device_info
        info = dict(getter())
    except Exception:
        pass
    for key, label in (
        ("max_recommended_working_set_size", "the GPU's recommended working set"),
        ("memory_size", "device memory"),
        ("total_memory", "device memory"),
    ):
        value = info.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return int(value), label
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "RAM"
    except (AttributeError, OSError, ValueError):
        return None, ""


def memory_in_use() -> tuple[int, int] | None:
    """(bytes in use, bytes there are) where MLX keeps its arrays, or None when unknown: on a
    GPU, MLX's own allocations (live arrays and its buffer cache) against `machine_memory`
    (CUDA's device memory, Metal's recommended working set); on the CPU, the host's RAM less
    what the kernel still counts available (/proc/meminfo)."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        total, _ = machine_memory()
        used = mx.get_active_memory() + mx.get_cache_memory()
        return (used, total) if total else None
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
        total = fields["MemTotal"]
        return total - fields["MemAvailable"], total
    except (OSError, KeyError, ValueError, IndexError):
        return None


# --- weights -----------------------------------------------------------------------------------


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """A safetensors file's header: 8 bytes little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER:
            raise ValueError(f"{path}: a safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    return header


def tensor_bytes(dtype: str, shape: list[int], offsets: Any = None) -> int:
    """One tensor's bytes: its byte range where given, else elements x its dtype's width."""
    if offsets and len(offsets) == 2:
        return int(offsets[1]) - int(offsets[0])
    return math.prod(int(d) for d in shape or ()) * DTYPE_BYTES.get(str(dtype).upper(), 2)


def header_bytes(header: dict[str, Any]) -> int:
    """The weight bytes a safetensors header describes (its `__metadata__` aside)."""
    return sum(
        tensor_bytes(info.get("dtype", ""), info.get("shape", []), info.get("data_offsets"))
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict)
    )


def _gguf_bytes(path: Path) -> int:
    from . import gguf

    try:
        return gguf.loaded_bytes(path)
    except CheckpointError:  # not a GGUF we read: its size is the best guess
        return path.stat().st_size


def local_weight_bytes(path: str | Path) -> int | None:
    """Weight bytes of a local model: a GGUF's once loaded (its header says: quantized tensors
    take more in MLX than in the file), or a folder's safetensors headers (a file whose header
    cannot be read counts its size); None when there are no weights."""
    path = Path(path)
    try:
        if path.is_file():
            return _gguf_bytes(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            ggufs = sorted(path.glob("*.gguf"))
            return _gguf_bytes(ggufs[0]) if len(ggufs) == 1 else None
    except OSError:
        return None
    total = 0
    for file in files:
        try:
            total += header_bytes(read_safetensors_header(file))
        except (OSError, ValueError, TypeError, KeyError, struct.error):
            try:
                total += file.stat().st_size
            except OSError:  # a dangling link: a download that never finished
                return None
    return total


_HUB = {"down_until": 0.0}  # after a call that could not connect, ask nothing for a minute


def _unreachable(error: BaseException) -> bool:
    """Whether an error says the Hub cannot be reached at all (not that a repo is missing)."""
    seen: BaseException | None = error
    while seen is not None:
        name = type(seen).__name__
        if isinstance(seen, OSError) or any(
            word in name for word in ("Connect", "Timeout", "Network", "Offline")
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def hub_unreachable() -> bool:
    """Whether a call in the last minute found the Hub unreachable."""
    return time.monotonic() < _HUB["down_until"]


def _ask_hub(call: Callable[[], Any]) -> Any:
    """`call()`, or None when it fails; for a minute after the Hub proved unreachable, None
    without asking (one failure costs one timeout, not one per repo and retry)."""
    if time.monotonic() < _HUB["down_until"]:
        return None
    try:
        return call()
    except Exception as e:
        if _unreachable(e):
            _HUB["down_until"] = time.monotonic() + 60
        return None


def hub_weight_bytes(repo: str) -> int | None:
    """Weight bytes of a Hub repo from its safetensors headers (HTTP range reads of the headers
    only), else the sizes of its .safetensors files; None when neither can be had."""
    from huggingface_hub import HfApi

    api = HfApi()

    def from_headers() -> int:
        meta = api.get_safetensors_metadata(repo)
        return sum(
            tensor_bytes(t.dtype, t.shape, t.data_offsets)
            for f in meta.files_metadata.values()
            for t in f.tensors.values()
        )

    def from_sizes() -> int | None:  # weights not named model*.safetensors (drafters, repacks)
        info = api.model_info(repo, files_metadata=True)
        sizes = [s.size for s in info.siblings or [] if s.rfilename.endswith(".safetensors")]
        return sum(s for s in sizes if s) or None

    found = _ask_hub(from_headers)
    return found if found is not None else _ask_hub(from_sizes)


def hub_file_bytes(repo: str, filename: str) -> int | None:
    """One file's size on the Hub (a GGUF)."""
    from huggingface_hub import HfApi

    infos = _ask_hub(lambda: HfApi().get_paths_info(repo, [filename]))
    return int(infos[0].size) if infos and getattr(infos[0], "size", None) else None


def hub_config(repo: str) -> dict[str, Any] | None:
    """A Hub repo's config.json, fetched into a temporary folder: never into the Hugging Face
    cache, where a lone config.json would pass for a downloaded model."""
    from huggingface_hub import hf_hub_download

    from .hub import DownloadState, ProgressSink, tqdm_kwargs

    quiet = ProgressSink(DownloadState(repo)).tqdm_class

    def fetch() -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            kwargs = tqdm_kwargs(hf_hub_download, quiet)
            path = hf_hub_download(repo, "config.json", local_dir=tmp, **kwargs)
            return json.loads(Path(path).read_text())

    config = _ask_hub(fetch)
    return config if isinstance(config, dict) else None


# --- the KV cache ------------------------------------------------------------------------------


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields, whether config.json nests them (multimodal) or not."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else dict(config)


def context_window(config: dict[str, Any], limit: int | None = None) -> int | None:
    """The model's own window (max_position_embeddings), or `limit` when that is smaller."""
    c = _text(config)
    native = next(
        (
            int(c[k])
            for k in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")
            if isinstance(c.get(k), int) and c[k] > 0
        ),
        None,
    )
    if limit and native:
        return min(int(limit), native)
    return int(limit) if limit else native


def value_bytes(config: dict[str, Any]) -> int:
    """Bytes per cached key/value element: 4 for float32 models, else 2 (bf16 / fp16, and the
    activations of quantized models)."""
    c = _text(config)
    dtype = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "")
    return 4 if dtype in ("float32", "float") else 2


def cached_layers(config: dict[str, Any], tokens: int) -> list[tuple[int, int, int]]:
    """(tokens, kv heads, head dim) for each layer that keeps a KV cache."""
    c = _text(config)
    layers = int(c.get("num_hidden_layers") or c.get("n_layer") or c.get("num_layers") or 0)
    heads = int(c.get("num_attention_heads") or c.get("n_head") or 0)
    if not layers or not heads:
        return []
    kv = int(c.get("num_key_value_heads") or heads)
    dim = int(c.get("head_dim") or int(c.get("hidden_size") or 0) // heads)
    if not dim:
        return []
    full = (
        tokens,
        int(c.get("num_global_key_value_heads") or kv),
        int(c.get("global_head_dim") or dim),
    )
    window = c.get("sliding_window") or c.get("attention_chunk_size")
    local = (min(int(window), tokens) if window else tokens, kv, dim)
    own = layers - int(c.get("num_kv_shared_layers") or 0)  # the rest reuse earlier caches
    kinds = c.get("layer_types")
    if isinstance(kinds, list) and kinds:
        out = []
        for kind in kinds[:own]:
            if kind == "full_attention":
                out.append(full)
            elif kind in ("sliding_attention", "chunked_attention", "local_attention"):
                out.append(local)
            # linear attention, Mamba, convolution layers: a fixed-size state, not counted
        return out
    pattern = c.get("hybrid_override_pattern")  # nemotron_h: "*" marks the attention layers
    if pattern:
        return [(tokens, kv, dim)] * "".join(pattern).count("*")
    interval = c.get("full_attention_interval")  # gated-delta hybrids: every n-th layer
    if interval:
        return [(tokens, kv, dim)] * (own // int(interval))
    every = c.get("sliding_window_pattern")  # gemma 3: every n-th layer global, others local
    if every and window:
        n_full = own // int(every)
        return [full] * n_full + [local] * (own - n_full)
    return [(tokens, kv, dim)] * own


def kv_cache_bytes(
    config: dict[str, Any], window: int | None = None, kv_bits: int | None = None
) -> int | None:
    """Bytes of the KV cache at the context window (`window` caps it); None if unknown. With
    `kv_bits` (`--kv-bits`) each value takes that many bits plus its group's scale and bias."""
    tokens = context_window(config, window)
    if not tokens:
        return None
    layers = cached_layers(config, tokens)
    if not layers and not _text(config).get("num_hidden_layers"):
        return None
    width = value_bytes(config)
    if kv_bits:
        from .kv_quant import KV_GROUP_SIZE  # the group of 64 the cache quantizes in

        width = kv_bits / 8 + 2 * width / KV_GROUP_SIZE
    return math.ceil(sum(2 * n * kv * dim * width for n, kv, dim in layers))


# --- pairs -------------------------------------------------------------------------------------


def local_config(path: Path) -> dict[str, Any] | None:
    try:
        if path.is_file():
            from . import gguf, gguf_header

            return gguf.read_config(path) if gguf_header.is_gguf(path) else None
        config = json.loads((path / "config.json").read_text())
        return config if isinstance(config, dict) else None
    except Exception:
        return None


def local_path(ref: str) -> Path | None:
    """Where a reference already is on this machine (no network), else None."""
    from .hub import resolve_model

    try:
        return resolve_model(ref, download=False)
    except Exception:
        return None


def model_bytes(
    ref: str, online: bool = False, locate: Callable[[str], Path | None] = local_path
) -> tuple[int | None, dict[str, Any] | None]:
    """(weight bytes, config) of a model reference: from local files where it is on this
    machine (`locate` finds them), else (with `online`) from the Hub's headers; (None, None)
    when unknown."""
    from .hub import looks_like_repo_id

    path = locate(ref)
    if path is not None:
        return local_weight_bytes(path), local_config(path)
    if not online:
        return None, None
    if ref.startswith("gguf:"):
        parts = ref.removeprefix("gguf:").split("/")
        if len(parts) < 3:
            return None, None
        return hub_file_bytes("/".join(parts[:2]), "/".join(parts[2:])), None
    if looks_like_repo_id(ref):
        weights = hub_weight_bytes(ref)
        return weights, hub_config(ref) if weights is not None else None
    return None, None


def registry_drafter(target: str) -> str | None:
    """The drafter `--mode auto` would load with this target (its registry row's)."""
    from ..registry import find_pair

    pair = find_pair(target)
    return pair.drafters.get(pair.mode) if pair is not None else None


def estimate(
    target: str,
    drafter: str | None = None,
    *,
    online: bool = False,
    window: int | None = None,
    memory: tuple[int | None, str] | None = None,
    locate: Callable[[str], Path | None] = local_path,
) -> Estimate:
    """The memory `target` (with `drafter`) needs at its context window (`window` caps it);
    `memory` is (bytes, what) when the caller already asked `machine_memory`."""
    weights, config = model_bytes(target, online, locate)
    kv = kv_cache_bytes(config, window) if config else None
    drafter_bytes = model_bytes(drafter, online, locate)[0] if drafter else None
    have, source = memory if memory is not None else machine_memory()
    return Estimate(
        weights=weights,
        kv_cache=kv,
        window=context_window(config, window) if config else None,
        drafter=drafter_bytes,
        memory=have,
        memory_source=source,
    )


def load_warning(
    target: str,
    drafter: str | None = None,
    *,
    window: int | None = None,
    kv_bits: int | None = None,
    rows: int = 1,
    memory: tuple[int | None, str] | None = None,
    locate: Callable[[str], Path | None] = local_path,
) -> str | None:
    """One line when a loaded target (with `drafter`), its KV cache filled to the context
    window in each of `rows` requests decoding together (`--max-batch`), would not fit this
    machine's memory, with the settings that would; None when it fits or nobody can tell.
    Reads only local files: call it once the model is on this machine."""
    weights, config = model_bytes(target, False, locate)
    if weights is None or not config:
        return None
    kv = kv_cache_bytes(config, window, kv_bits)
    tokens = context_window(config, window)
    have, source = memory if memory is not None else machine_memory()
    if not kv or not tokens or not have:
        return None
    fixed = weights + ((model_bytes(drafter, False, locate)[0] or 0) if drafter else 0)
    if fixed + rows * kv <= have:
        return None
    each = f" ({rows} requests decoding together)" if rows > 1 else ""
    ways = []
    fits_tokens = (have - fixed) * tokens // (rows * kv) // 1024 * 1024
    if fits_tokens >= 1024:
        ways.append(f"--context-window {fits_tokens}")
    for bits in (8, 4):
        if not kv_bits or bits < kv_bits:
            smaller = kv_cache_bytes(config, window, bits) or 0
            ways.append(f"--kv-bits {bits} ({gb(rows * smaller)} of KV cache)")
    if rows > 1:
        ways.append("a smaller --max-batch")
    return (
        f"{target}: {gb(fixed)} of weights and {gb(rows * kv)} of KV cache at the full context "
        f"window of {tokens:,} tokens{each} come to {gb(fixed + rows * kv)}, more than this "
        f"machine's {gb(have)} ({source}); long conversations could run out of memory. "
        + ("What would fit: " + ", or ".join(ways) + "." if ways else "")
    )


def download_warning(target: str, window: int | None = None) -> str | None:
    """One line when `target` (with its registry drafter) will not fit this machine; None when
    it fits or nobody can tell. Reads the Hub's headers: call it when a download is about to
    happen anyway."""
    est = estimate(target, registry_drafter(target), online=True, window=window)
    if est.fits is not False:
        return None
    return (
        f"{target} will likely not fit in this machine's memory: {est.summary()} (an estimate) "
        f"against {gb(est.memory)} of {est.memory_source}; downloading anyway"
    )
