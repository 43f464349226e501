"""Multi-row attention that avoids MLX's slow CUDA cases: verify rows on the one-query kernel,
half-precision forwards at a few bucketed shapes, batched ones on plain matmuls.

On MLX's CUDA backend `mx.fast.scaled_dot_product_attention` runs its fused vector kernel only
for fewer than 4 float32 query rows (one row in half precision); a verify forward of 5 or 8 rows
(cap 4 or 7) falls back to separate matmul, mask and softmax kernels in float32, which made a
5-row forward of the demo target cost 1.8x a one-row one on the H200
(docs/receipts/verify_kernels_h200.txt). Split into causal chunks the kernel takes, each chunk
seeing the keys up to its own last row, the same attention runs as a few fused kernels, and
each row is computed by the kernel plain decoding uses.

In half precision, MLX 0.32's CUDA attention for two or more query rows is cuDNN's, and it
builds a cuDNN graph for every new combination of query length, key length and mask shape
(45-70 ms for the 8B shape on the H200), keeping the last 256. Speculative decoding meets a
new key length every round, a batch with a new mask every round, and a prefix-cache hit's
suffix or a prefill's last, shorter chunk a new pair in nearly every request. Measured on the
H200 with shapes no earlier request had met (docs/performance.md, "Half precision"):
turn 5 of a conversation with an 8B model took 70 ms to its first token with MLX's own path
and 30 ms with the paths below; 32 requests through 8 batched rows of a 0.6B model, with drafts
right 4 times in 5, ran at 251 tok/s against 665-687. So in half precision a verify's rows go
one per kernel call (the vector kernel, or cuDNN's decoding graph, which is keyed by the cache
buffer's size and so reused), and forwards of more rows than a verify (fewer than a full
prefill chunk, with a bounded score matrix) and every multi-row batched forward run as matmul,
mask and softmax (what MLX computes where it has no fused kernel), whose kernels do not depend
on the lengths. Full 512-row prefill chunks keep cuDNN: their shapes repeat from one request
to the next.

Those exact-shape paths still paid for meeting new shapes (docs/performance.md, "Bucketed
attention"). So with buckets on (the default; OUTRIDER_ATTENTION_BUCKETS=off keeps the exact
shapes), a half-precision call of BUCKET_FROM or more rows and fewer than a full prefill chunk
over a plain `KVCache`, whose padded score matrix stays within UNFUSED_SCORES, runs at a
bucketed shape (`bucketed_attention` in attention_forms.py, which says how; `all` also
buckets a batch's rows, `bucketed_rows_attention`, not yet timed on a GPU).

`ChunkedAttention` wraps one model instance's attention module (never the class); one-row
calls, full prefill chunks and any call it does not recognise go to the wrapped module
unchanged. It knows the mlx-lm attention layout shared by llama, qwen2, qwen3 and mistral
(q/k/v/o projections, optional per-head q/k norms, one rope), the gated-delta hybrids'
attention layers (qwen3_next's, which qwen3_5 and qwen3_5_moe use: the same with a gate split
off the query projection) and Nemotron-H's (projections only, no rope).

`SharedKVAttention` does the same for Gemma-4 (mlx-lm gemma4_text, every layer): sliding
layers (a `RotatingKVCache`), global ones (a `KVCache`, k = v on some), layers that read an
earlier layer's keys and values, and their batched caches. It reuses the layer's own
projections, norms and rope, and attends over the keys the cache's update returns under the
mask the model built for that layer's kind, so it needs no knowledge of the window: a
"causal" mark (global layers; a window not yet full) splits verify rows as above, and a
window's band or a batch's mask (boolean arrays) goes, whole, to matmul attention in half
precision; in float32 those keep MLX's call. mlx-vlm's Gemma-4 tower and quantized KV caches
keep their own attention.

`install` checks the layout, then checks on a short input that the wrapped forward agrees with
the model's own before it keeps the wrappers (with sliding windows, also past the longest
window, once it has wrapped). `OUTRIDER_ATTENTION=native` leaves MLX's own path everywhere;
`split` installs the wrappers on any device (the CPU tests use it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from ...core.device import (
    attention_buckets,
    batch_buckets,
    fused_attention,
    on_cuda_gpu,
    split_attention,
)
from ...core.kv_quant import DequantizingKVCache
from ...core.wrapper import PassThrough
from .attention_forms import (
    CHUNK,
    KEY_STEP,
    Buckets,
    bucket_rows,
    bucketed_attention,
    bucketed_rows_attention,
    chunked_causal_attention,
    matmul_attention,
    reserve,
    whole_steps,
)
from .batched import QuantizedRows

# Bucketed half-precision attention (attention_forms.py) takes calls of BUCKET_FROM to
# UNFUSED_BELOW - 1 rows.
BUCKET_FROM = 3
MAX_ROWS = 16  # wider forwards (prefill) are not split
# Half-precision forwards of 2 to UNFUSED_BELOW - 1 rows that are not split take matmul
# attention when their score matrix (rows x heads x queries x keys) holds at most
# UNFUSED_SCORES entries: the prefill's own chunks (core/target.py PREFILL_CHUNK, 512 rows)
# keep cuDNN, and so does a long context, where the scores would cost more memory traffic than
# a graph build costs time.
UNFUSED_BELOW = 512
UNFUSED_SCORES = 1 << 27
HALF = (mx.float16, mx.bfloat16)
LAYOUT = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
MODULES = ("llama", "qwen2", "qwen3", "mistral", "nanbeige")  # mlx_lm.models.* of that layout
# The gated-delta hybrids' attention layers (qwen3_next, and qwen3_5 / qwen3_5_moe, which
# import it): the same layout, with q_proj also giving a gate the output is multiplied by.
GATED = ("qwen3_next", "Qwen3NextAttention")
# Nemotron-H's attention layers: q/k/v/o projections and nothing else (no rope: the Mamba-2
# layers carry position), under the layer's `mixer`.
UNROTATED = ("nemotron_h", "NemotronHAttention")
# Gemma-4's attention (mlx-lm gemma4_text): q/k norms and a scale-free v norm, a rope per
# layer kind, k = v on some global layers, and KV-shared layers that take an earlier layer's
# keys and values; it is called with (and returns) those keys, values and rope offset.
SHARED_KV = ("gemma4_text", "Attention")
# LiquidAI LFM2's attention layers (mlx-lm lfm2, lfm2_moe): the same layout under other names
# for the q/k norms and the output projection.
RENAMED = {
    layout: {"q_norm": "q_layernorm", "k_norm": "k_layernorm", "o_proj": "out_proj"}
    for layout in (("lfm2", "Attention"), ("lfm2_moe", "Attention"))
}
# the caches `SharedKVAttention` computes around: what their update returns and the mask the
# model made for them are all it uses (a quantized cache has its own attention: it passes)
WINDOWED_CACHES = (KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache)
# each layout's attribute names for its query and key/value head counts
HEADS = {GATED: ("num_attention_heads", "num_key_value_heads"),
         UNROTATED: ("num_heads", "num_key_value_heads")}  # fmt: skip
PLAIN_HEADS = ("n_heads", "n_kv_heads")
# How far the probe's logits may part, relative to the largest |logit|: kernel shapes round
# differently (TF32 matmuls on CUDA by ~1e-3, half precision by a few of its 8-bit steps); a
# wrong layout, mask or rope parts them by O(1).
PROBE_TOLERANCE = {mx.float32: 1e-2}
HALF_PROBE_TOLERANCE = 5e-2
# rows per forward the probe takes to pass a sliding window longer than its first forwards
PROBE_FILL = 256


class ChunkedAttention(PassThrough):
    """One decoder layer's attention, with verify-width calls split into kernel-sized chunks
    (`half`: half-precision ones too) and, with `unfused`, the other multi-row half-precision
    calls run as plain matmuls; with `buckets`, half-precision calls over a plain KVCache run
    at bucketed shapes instead (`bucketed_attention`), and with `batches` too a batch's rows
    over a BatchKVCache (`bucketed_rows_attention`)."""

    wrapped = "attention"
    route = "split"

    def __init__(
        self,
        attention: nn.Module,
        half: bool = False,
        unfused: bool = False,
        buckets: Buckets | None = None,
        batches: bool = False,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.half = half  # split half-precision calls too, one row per kernel call
        self.unfused = unfused  # other multi-row half-precision calls: matmul attention
        self.buckets = buckets  # half-precision calls over a KVCache: bucketed attention
        self.batches = batches  # and over a BatchKVCache (OUTRIDER_ATTENTION_BUCKETS=all)
        layout = _layout(attention)
        self.gated = layout == GATED
        self.heads, self.kv_heads = (getattr(attention, h) for h in HEADS.get(layout, PLAIN_HEADS))
        names = RENAMED.get(layout, {})
        self.q_norm, self.k_norm, self.o_proj = (
            names.get(n, n) for n in ("q_norm", "k_norm", "o_proj")
        )

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        attend = self.attention_for(x, mask, cache)
        if attend is None:
            return self.attention(x, mask=mask, cache=cache)
        return self._attend(x, cache, attend)

    def attention_for(self, x: mx.array, mask: Any, cache: Any) -> Callable | None:
        """How a call of x's rows under `mask` over `cache` attends, `attend(q, keys, values)`
        over the keys and values the cache's update returns, or None where the model's own
        attention stays. A bucketed call lays out the cache's room here, before the update
        (core/compiled_layers.py asks this too, around its own projections)."""
        kind = type(cache)
        if kind is KVCache and _is_causal(mask) and self._bucketed(x, cache.offset + x.shape[1]):
            buckets, scale = self.buckets, self.attention.scale
            reserve(cache, x.shape[1])
            return lambda q, k, v: bucketed_attention(q, cache, scale, buckets)
        if (
            kind is BatchKVCache
            and self.batches
            and _is_boolean(mask)
            and self._bucketed(x, mask.shape[-1])
        ):
            buckets, scale = self.buckets, self.attention.scale
            reserve(cache, x.shape[1])
            return lambda q, k, v: bucketed_rows_attention(q, cache, mask, scale, buckets)
        if kind in (KVCache, DequantizingKVCache) and _is_causal(mask):
            return self._kernel(x, mask, cache.offset + x.shape[1])
        if kind in (BatchKVCache, QuantizedRows) and _is_boolean(mask):
            return self._kernel(x, mask, mask.shape[-1])
        return None

    def _kernel(self, x: mx.array, mask: Any, keys: int) -> Callable | None:
        """The attention of a call of x's rows over `keys` keys with the model's own `mask`
        (a causal mark or a boolean array), or None where MLX's own kernel stays: verify
        widths under a causal mask one kernel-sized chunk at a time, and other multi-row
        half-precision calls (a boolean mask's too) as matmul attention."""
        n, scale = x.shape[1], self.attention.scale
        if _is_causal(mask):
            chunk = CHUNK.get(x.dtype, 1 if self.half else MAX_ROWS)
            if chunk < n <= MAX_ROWS:
                return lambda q, k, v: chunked_causal_attention(q, k, v, scale, chunk)
            mask = None  # matmul_attention's own causal mask
        elif not _is_boolean(mask):
            return None
        if self._unfused(x, n, keys):
            return lambda q, k, v: matmul_attention(q, k, v, scale, mask)
        return None

    def _bucketed(self, x: mx.array, keys: int) -> bool:
        """Whether this call of x's rows over `keys` keys takes bucketed attention: buckets
        on, half precision, BUCKET_FROM to UNFUSED_BELOW - 1 rows, and a padded score matrix
        within UNFUSED_SCORES (a long context keeps MLX's fused kernel, which never holds the
        scores: at 32k keys a 512-row chunk's would take gigabytes a layer)."""
        b, n = x.shape[:2]
        if self.buckets is None or x.dtype not in HALF or not BUCKET_FROM <= n < UNFUSED_BELOW:
            return False
        padded_keys = whole_steps(keys) + KEY_STEP  # at most a step past
        return b * self.heads * bucket_rows(n) * padded_keys <= UNFUSED_SCORES

    def _unfused(self, x: mx.array, n: int, keys: int) -> bool:
        """Whether this call takes matmul attention: half precision, 2 to UNFUSED_BELOW - 1
        rows, and a score matrix within UNFUSED_SCORES."""
        scores = x.shape[0] * self.heads * n * keys
        return (
            self.unfused and x.dtype in HALF and 1 < n < UNFUSED_BELOW and scores <= UNFUSED_SCORES
        )

    def _attend(self, x: mx.array, cache: Any, attend: Callable) -> mx.array:
        """The wrapped layer's projections, norms, rope and cache update around `attend`."""
        a = self.attention
        b, n, _ = x.shape
        q = a.q_proj(x).reshape(b, n, self.heads, -1)
        if self.gated:
            q, gate = mx.split(q, 2, axis=-1)
        k = a.k_proj(x).reshape(b, n, self.kv_heads, -1)
        if self.q_norm in a:
            q, k = a[self.q_norm](q), a[self.k_norm](k)
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        if "rope" in a:
            q = a.rope(q, offset=cache.offset)
            k = a.rope(k, offset=cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        out = attend(q, keys, values).transpose(0, 2, 1, 3).reshape(b, n, -1)
        if self.gated:
            out = out * mx.sigmoid(gate.reshape(b, n, -1))
        return a[self.o_proj](out)


class SharedKVAttention(ChunkedAttention):
    """Gemma-4's attention layer (mlx-lm gemma4_text) with `ChunkedAttention`'s kernels: a
    layer with its own keys (a sliding window's `RotatingKVCache`, a global layer's `KVCache`,
    or their batched kinds) or one reading an earlier layer's (`shared_kv`, no cache).

    Every call it takes attends as the model's own would: over the keys and values the cache's
    update returns (a wrapped window's in temporal order, the queries' own last), under the
    mask the model made for this layer's kind. A "causal" mark means every row sees every
    earlier key, so verify rows split as in `ChunkedAttention`; a window's or a batch's
    boolean mask goes to matmul attention as it is (half precision only; elsewhere MLX's
    own call stays), never split, since its rows see different keys."""

    def __call__(
        self,
        x: mx.array,
        mask: Any = None,
        cache: Any = None,
        shared_kv: tuple | None = None,
        offset: Any = None,
    ) -> tuple[mx.array, tuple, Any]:
        a = self.attention
        attend = None
        if shared_kv is not None and cache is None:
            attend = self._kernel(x, mask, shared_kv[0].shape[2])
        elif shared_kv is None and a.has_kv and _windowed(cache):
            keys = mask.shape[-1] if _is_boolean(mask) else cache.size() + x.shape[1]
            attend = self._kernel(x, mask, keys)
        if attend is None:
            return a(x, mask, cache, shared_kv=shared_kv, offset=offset)
        q = a.q_norm(a.q_proj(x).reshape(*x.shape[:2], self.heads, -1)).transpose(0, 2, 1, 3)
        if shared_kv is None:
            offset = mx.array(cache.offset)  # the positions of x's rows (a batch: per row)
            keys, values = cache.update_and_fetch(*self._own_kv(x, offset))
        else:
            keys, values = shared_kv  # the earlier layer's, already holding x's rows
        out = attend(a.rope(q, offset=offset), keys, values)
        out = a.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))
        return out, (keys, values), offset

    def _own_kv(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        """x's keys (normed, rotated) and values (normed by the scale-free norm; the keys'
        projection where the layer has k = v), [B, Hkv, L, D] each."""
        a = self.attention
        b, n, _ = x.shape
        k = a.k_proj(x).reshape(b, n, self.kv_heads, -1)
        v = k if a.use_k_eq_v else a.v_proj(x).reshape(b, n, self.kv_heads, -1)
        k = a.rope(a.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
        return k, a.v_norm(v).transpose(0, 2, 1, 3)


def _windowed(cache: Any) -> bool:
    """Whether `cache` is one `SharedKVAttention` computes around."""
    return isinstance(cache, WINDOWED_CACHES) and not hasattr(cache, "bits")


def _is_causal(mask: Any) -> bool:
    return isinstance(mask, str) and mask == "causal"


def _is_boolean(mask: Any) -> bool:
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_


def _layout(attention: nn.Module) -> tuple[str, str]:
    """(the mlx_lm.models module, the class name) of an attention module."""
    return type(attention).__module__.rsplit(".", 1)[-1], type(attention).__name__


def fits(attention: nn.Module) -> bool:
    """Whether `attention` has an mlx-lm layout `ChunkedAttention` re-states."""
    layout = _layout(attention)
    if layout == SHARED_KV:
        return _fits_shared_kv(attention)
    if layout == GATED:
        if "q_norm" not in attention:
            return False
    elif layout == UNROTATED:
        if "rope" in attention or "q_norm" in attention:
            return False
    elif layout in RENAMED:
        if not all(name in attention for name in RENAMED[layout].values()):
            return False
    elif layout[0] not in MODULES or layout[1] != "Attention":
        return False
    names = RENAMED.get(layout, {})
    parts = [names.get(n, n) for n in (LAYOUT if layout != UNROTATED else LAYOUT[:-1])]
    if not all(name in attention for name in parts):
        return False
    if (names.get("q_norm", "q_norm") in attention) != (names.get("k_norm", "k_norm") in attention):
        return False
    return all(hasattr(attention, a) for a in (*HEADS.get(layout, PLAIN_HEADS), "scale"))


def _fits_shared_kv(attention: nn.Module) -> bool:
    """Whether a gemma4_text attention has what `SharedKVAttention` reads: a layer with its
    own keys has k/v projections (no v one where k = v) and norms, a KV-shared one none."""
    has_kv = getattr(attention, "has_kv", None)
    k_eq_v = getattr(attention, "use_k_eq_v", None)
    if not isinstance(has_kv, bool) or not isinstance(k_eq_v, bool):
        return False
    parts = ["q_proj", "o_proj", "q_norm", "rope"]
    if has_kv:
        parts += ["k_proj", "k_norm", "v_norm"] + ([] if k_eq_v else ["v_proj"])
    if not all(name in attention for name in parts):
        return False
    return all(hasattr(attention, a) for a in (*PLAIN_HEADS, "scale"))


def install(
    model: nn.Module,
    layers: list,
    make_cache: Callable[[], list],
    attr: str = "self_attn",
    attends: Callable[[nn.Module], bool] = lambda layer: True,
) -> bool:
    """Wrap the attention module (`layer[attr]`) of every layer in `layers` (the model's own
    list) that has one and `attends`, when it is wanted and every one fits, and keep the
    wrappers only if a short verify after a short prefill gives the model's own logits.
    Returns whether the wrappers stay."""
    if not split_attention():
        return False
    layers = [layer for layer in layers if attr in layer and attends(layer)]
    if not layers or not all(fits(layer[attr]) for layer in layers):
        return False
    reference, dtype = _probe(model, make_cache)
    if dtype not in CHUNK and dtype not in HALF:
        return False
    originals = []
    masks = None
    if dtype in HALF and attention_buckets():
        masks = Buckets(kernel=on_cuda_gpu(), fused=fused_attention())
    for layer in layers:
        originals.append(layer[attr])
        if _layout(layer[attr]) == SHARED_KV:
            wrapper = SharedKVAttention(layer[attr], dtype in HALF, unfused=dtype in HALF)
        else:
            wrapper = ChunkedAttention(
                layer[attr],
                dtype in HALF,
                dtype in HALF,
                masks,
                masks is not None and batch_buckets(),
            )
        layer[attr] = wrapper
    limit = PROBE_TOLERANCE.get(dtype, HALF_PROBE_TOLERANCE) * mx.abs(reference).max().item()
    agrees = _agrees(model, make_cache, reference, limit)
    if not agrees and masks is not None and masks.fused:
        masks.fused = None  # fused kernels that did not build or agree: the softmax kernel's
        agrees = _agrees(model, make_cache, reference, limit)
    if not agrees and masks is not None and masks.kernel:
        masks.kernel = None  # a softmax kernel that did not build or agree: MLX's own ops
        agrees = _agrees(model, make_cache, reference, limit)
    if not agrees:
        for layer, original in zip(layers, originals):
            layer[attr] = original
    return agrees


def _agrees(
    model: nn.Module, make_cache: Callable[[], list], reference: mx.array, limit: float
) -> bool:
    """Whether the probe's logits through the installed wrappers are within `limit` of the
    model's own (`reference`); a forward that raises does not agree."""
    try:
        got, _ = _probe(model, make_cache)
        return mx.abs(got - reference).max().item() <= limit + 1e-6
    except Exception:  # a layout that only looked like a known one: the model's own path
        return False


def _probe(model: nn.Module, make_cache: Callable[[], list]) -> tuple[mx.array, mx.Dtype]:
    """Logits (as float32, and their own dtype) of an 8-row verify after a 4-token prefill
    (chunks of 3, 3 and 2 rows in float32, 8 single rows in half precision), then of a 20-row
    forward (matmul attention in half precision). With sliding windows, the forwards then go
    on past the longest window (in chunks of PROBE_FILL rows), and one row, another 8-row
    verify and 20-row forward follow over the wrapped windows, whose masks are bands."""
    cache = make_cache()
    window = max((c.max_size for c in cache if isinstance(c, RotatingKVCache)), default=0)
    feeds = [(4, False), (8, True), (20, True)]
    if window:
        fill = max(0, window - 32)
        feeds += [(min(PROBE_FILL, fill - i), False) for i in range(0, fill, PROBE_FILL)]
        feeds += [(1, True), (8, True), (20, True)]
    logits, done = [], 0
    for rows, compared in feeds:
        ids = [1 + (done + i) % 32 for i in range(rows)]  # 1..32, as in any vocabulary
        out = model(mx.array([ids], dtype=mx.uint32), cache=cache)
        mx.eval(out if compared else [c.state for c in cache])
        if compared:
            logits.append(out)
        done += rows
    logits = mx.concatenate(logits, axis=1)
    as_f32 = logits.astype(mx.float32)
    mx.eval(as_f32)
    return as_f32, logits.dtype
