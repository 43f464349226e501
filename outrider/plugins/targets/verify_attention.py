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

Those exact-shape paths still paid for meeting new shapes: at 97 rows over 4,224 keys with
the 32B shape's heads in bf16, matmul attention took 18 ms over 64 layers at a fixed key length
and 31-34 ms with the key length growing (MLX's CUDA backend prepares its work per shape),
and one row per kernel call cost 0.5-1 ms a row for an 8B verify
(`benchmarks/verify_forward_ablation.py --sdpa`, docs/performance.md, "Bucketed attention").
So with buckets on (the default; OUTRIDER_ATTENTION_BUCKETS=off keeps the exact shapes), a
half-precision call of BUCKET_FROM or more rows and fewer than a full prefill chunk over a
plain `KVCache`, whose padded score matrix stays within UNFUSED_SCORES, runs at a bucketed
shape (`all` also buckets a batch's rows, `bucketed_rows_attention`; not yet timed on a
GPU): query rows padded to `bucket_rows` (8, 16, then multiples of 16), keys to the cache's
buffer, a whole number of KEY_STEP (mlx-lm's own growth step; laid so before the update where
the buffer is too short, and re-laid once where a restore left it otherwise), as the
stacked-head products of matmul attention around a causal
softmax (`Buckets.softmax`) that gives every padded key weight exactly zero, so padded rows
and keys never reach a real row's output. The shapes then change once per 256 keys, not every
call. On a CUDA GPU that softmax is one kernel of our own (`CAUSAL_SOFTMAX`, through
`mx.fast.cuda_kernel`) that reads the scores once and computes each row's mask from its
index, instead of `mx.where` and `mx.softmax` reading and writing the whole score matrix twice:
at that shape 11.8 ms against 25 ms, and 2.3-2.5 ms against 4.3-7.1 ms (one row per call) for
an 8B verify of 5-8 rows at 4k keys. (cuDNN's fused kernel takes 3.8 ms at a shape whose graph
it has built, but a mask array, which bucketed shapes need, took it to 18 ms, and every new
shape costs a 40-60 ms build.)

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
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from ...core.device import attention_buckets, batch_buckets, on_cuda_gpu, split_attention
from ...core.kv_quant import DequantizingKVCache
from ...core.wrapper import PassThrough
from .batched import QuantizedRows

# Bucketed half-precision attention (module docstring): keys padded to a multiple of KEY_STEP
# (mlx-lm KVCache's growth step), query rows to BUCKET_ROWS or a multiple of 16
# (`bucket_rows`), for calls of BUCKET_FROM to UNFUSED_BELOW - 1 rows.
KEY_STEP = 256
BUCKET_ROWS = 8
BUCKET_FROM = 3
# Query rows per kernel call in a verify: MLX's CUDA vector kernel takes up to 3 float32 rows,
# and one row in half precision.
CHUNK = {mx.float32: 3}
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
MODULES = ("llama", "qwen2", "qwen3", "mistral")  # mlx_lm.models.* with that exact layout
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


def chunked_causal_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, chunk: int | None = None
) -> mx.array:
    """Causal attention of q [B, H, L, D] over k, v [B, Hkv, S, D], whose last L rows are the
    queries' own, as ceil(L / chunk) kernel calls: chunk rows [i, j) see keys [0, S - L + j)."""
    n, s = q.shape[2], k.shape[2]
    chunk = chunk or CHUNK.get(q.dtype, 1)
    parts = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        end = s - n + stop
        parts.append(
            mx.fast.scaled_dot_product_attention(
                q[:, :, start:stop], k[:, :, :end], v[:, :, :end], scale=scale, mask="causal"
            )
        )
    return mx.concatenate(parts, axis=2)


def matmul_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | None = None,
    weigh: Callable[[mx.array], mx.array] | None = None,
) -> mx.array:
    """Attention of q [B, H, L, D] over k, v [B, Hkv, S, D] as matmul, mask and softmax, no
    kernel of which depends on L or S. `mask` is a boolean [B, 1, L, S] or [L, S] (True:
    attend; a batch's causal mask with each row's padding, a sliding window's band); None
    means causal, the last L keys being the queries' own. `weigh`, where given, turns the
    stacked scores [B, Hkv, repeats * L, S] into weights instead of the mask and softmax (a
    kernel that masks by itself: `Buckets.softmax`)."""
    b, h, n, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    repeats = h // kv_heads
    # The query heads that share a KV head are stacked as rows of one product with its keys:
    # two plain batched matmuls. (Broadcasting the keys over a repeats axis instead cost the
    # H200 ~0.4-0.55 ms a layer at 97 rows over 4k keys, docs/performance.md.)
    q = (q * scale).reshape(b, kv_heads, repeats * n, d)
    scores = q @ k.swapaxes(-1, -2)
    if weigh is not None:
        return (weigh(scores) @ v).reshape(b, h, n, d)
    scores = scores.reshape(b, kv_heads, repeats, n, s)
    if mask is None:
        mask = create_causal_mask(n, offset=s - n)  # row i: keys up to s - n + i
    elif mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)  # the repeats' axis
    scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(b, kv_heads, repeats * n, s)
    return (weights @ v).reshape(b, h, n, d)


def bucket_rows(n: int) -> int:
    """The rows a bucketed call of n query rows computes: BUCKET_ROWS or 16 up to 16 rows,
    else the next multiple of 16 (little padding, and few shapes a conversation meets)."""
    return BUCKET_ROWS if n <= BUCKET_ROWS else -(-n // 16) * 16


def _used(cache: KVCache | BatchKVCache) -> int:
    """How many key columns of the cache's buffers hold keys: a `KVCache`'s offset, a
    `BatchKVCache`'s shared column count (its rows' offsets differ by their left padding)."""
    return cache._idx if isinstance(cache, BatchKVCache) else cache.offset


def _whole_steps(length: int) -> int:
    """`length` rounded up to a whole number of KEY_STEP."""
    return -(-length // KEY_STEP) * KEY_STEP


def _lay_out(cache: KVCache | BatchKVCache, length: int) -> None:
    """Copy the columns in use of `cache`'s buffers into new ones `length` long (zeros past)."""
    s = _used(cache)
    pad = [(0, 0), (0, 0), (0, length - s), (0, 0)]
    cache.keys = mx.pad(cache.keys[..., :s, :], pad)
    cache.values = mx.pad(cache.values[..., :s, :], pad)


def reserve(cache: KVCache | BatchKVCache, n: int) -> None:
    """Before `cache`'s update with n rows: where its buffers are too short for them, lay its
    first `offset` rows into buffers of the next multiple of KEY_STEP past offset + n, so the
    update writes in place and `bucket_buffers` finds them bucketed (rather than mlx-lm's
    growth copying the cache once and a re-lay a second time). An empty cache is left to
    mlx-lm, whose first buffers are whole steps."""
    if cache.keys is not None and _used(cache) + n > cache.keys.shape[2]:
        _lay_out(cache, _whole_steps(_used(cache) + n))


def bucket_buffers(cache: KVCache | BatchKVCache) -> tuple[mx.array, mx.array]:
    """`cache`'s key and value buffers (after its update), their length a multiple of KEY_STEP
    less than two steps past the columns in use (`_used`). Where it is not (a restored prefix,
    a growth from a length off the step, a batch's rows filtered), the columns in use are
    re-laid into buffers of the next multiple, which the cache keeps: mlx-lm's caches write
    into their buffers in place and read only the columns in use, so longer buffers hold the
    same cache."""
    s, length = _used(cache), cache.keys.shape[2]
    if length % KEY_STEP or length - s >= 2 * KEY_STEP:
        _lay_out(cache, _whole_steps(s))
    return cache.keys, cache.values


# Softmax over a bucketed call's scores in one pass on CUDA: row r of [R, S] scores is query
# row r % rows of n real ones over s real keys; it sees keys up to min(s - n + r % rows, s - 1)
# and gives the rest weight 0. Float32 inside, as `mx.softmax(precise=True)`. One block a row:
# each thread reads 16 bytes at a time (S is a multiple of KEY_STEP), keeps a running maximum
# and sum (an online softmax), and the block combines them; then it writes the weights.
CAUSAL_SOFTMAX = """
const int row = blockIdx.x;
const int S = params[0], s = params[1], n = params[2], rows = params[3];
const int last = min(s - n + row % rows, s - 1);
const T* x = scores + (size_t)row * S;
T* y = weights + (size_t)row * S;
constexpr int V = 16 / sizeof(T);
const int stride = blockDim.x * V;
float m = -INFINITY, sum = 0.f;
for (int j0 = threadIdx.x * V; j0 <= last; j0 += stride) {
  uint4 raw = *reinterpret_cast<const uint4*>(x + j0);
  const T* v = reinterpret_cast<const T*>(&raw);
  float f[V];
  float top = -INFINITY;
  for (int k = 0; k < V; ++k) {
    f[k] = j0 + k <= last ? static_cast<float>(v[k]) : -INFINITY;
    top = fmaxf(top, f[k]);
  }
  if (top > m) {
    sum = m > -INFINITY ? sum * expf(m - top) : 0.f;
    m = top;
  }
  if (m > -INFINITY) {
    for (int k = 0; k < V; ++k) sum += expf(f[k] - m);
  }
}
__shared__ float part_m[32], part_s[32];
for (int o = 16; o > 0; o >>= 1) {
  const float m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, sum, o);
  const float top = fmaxf(m, m2);
  sum = (m > -INFINITY ? sum * expf(m - top) : 0.f) + (m2 > -INFINITY ? s2 * expf(m2 - top) : 0.f);
  m = top;
}
if ((threadIdx.x & 31) == 0) {
  part_m[threadIdx.x >> 5] = m;
  part_s[threadIdx.x >> 5] = sum;
}
__syncthreads();
m = -INFINITY;
for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, part_m[w]);
sum = 0.f;
for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
  if (part_m[w] > -INFINITY) sum += part_s[w] * expf(part_m[w] - m);
}
const float inv = 1.f / sum;
for (int j0 = threadIdx.x * V; j0 < S; j0 += stride) {
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
  if (j0 <= last) {
    uint4 raw = *reinterpret_cast<const uint4*>(x + j0);
    const T* v = reinterpret_cast<const T*>(&raw);
    for (int k = 0; k < V; ++k) {
      o[k] = static_cast<T>(j0 + k <= last ? expf(static_cast<float>(v[k]) - m) * inv : 0.f);
    }
  } else {
    for (int k = 0; k < V; ++k) o[k] = static_cast<T>(0.f);
  }
  *reinterpret_cast<uint4*>(y + j0) = out;
}
"""
SOFTMAX_THREADS = 256


class Buckets:
    """What a wrapped model's bucketed attention calls share within a forward (one instance
    per model): the causal mask of the call's shape, built once for all layers, and on a CUDA
    GPU a one-pass causal softmax kernel instead of `mx.where` and `mx.softmax` (which read
    and write the whole score matrix twice; `kernel`)."""

    def __init__(self, kernel: bool = False) -> None:
        self._key: tuple[int, int, int, int] | None = None
        self._mask: mx.array | None = None
        self._params: mx.array | None = None
        self.kernel = None  # the CUDA softmax kernel, or None for MLX's own ops
        if kernel:
            try:  # compiled at its first call (the load's probe, which drops a failing route)
                self.kernel = mx.fast.cuda_kernel(
                    "outrider_causal_softmax",
                    input_names=["scores", "params"],
                    output_names=["weights"],
                    source=CAUSAL_SOFTMAX,
                )
            except Exception:  # an MLX build without custom CUDA kernels: MLX's own ops
                self.kernel = None

    def _shape(self, s: int, n: int, rows: int, keys: int) -> None:
        if self._key != (s, n, rows, keys):
            self._key = (s, n, rows, keys)
            self._mask = self._params = None

    def mask(self, s: int, n: int, rows: int, keys: int) -> mx.array:
        """[rows, keys] boolean: row i of n new rows over s keys sees keys up to s - n + i; a
        padded row (i >= n) sees every real key (its output is dropped); none sees a key at or
        past s."""
        self._shape(s, n, rows, keys)
        if self._mask is None:
            last = mx.minimum(mx.arange(rows) + (s - n), s - 1)
            self._mask = mx.arange(keys)[None] <= last[:, None]
        return self._mask

    def softmax(self, scores: mx.array, s: int, n: int, rows: int) -> mx.array:
        """The causal softmax of scores [B, Hkv, repeats * rows, keys] (each KV head's query
        heads stacked as rows) by the kernel, float32 inside, with `mask`'s rows."""
        keys = scores.shape[-1]
        self._shape(s, n, rows, keys)
        if self._params is None:
            self._params = mx.array([keys, s, n, rows], dtype=mx.int32)
        count = scores.size // keys
        return self.kernel(
            inputs=[scores, self._params],
            template=[("T", scores.dtype)],
            grid=(count * SOFTMAX_THREADS, 1, 1),
            threadgroup=(SOFTMAX_THREADS, 1, 1),
            output_shapes=[scores.shape],
            output_dtypes=[scores.dtype],
        )[0]


def bucketed_attention(q: mx.array, cache: KVCache, scale: float, buckets: Buckets) -> mx.array:
    """Causal attention of q [B, H, n, D] (the last n of `cache`'s keys are its own) at a
    bucketed shape: rows padded to `bucket_rows`, keys to `bucket_buffers`, as matmul
    attention under `Buckets.mask`, or around `Buckets.softmax` where the kernel runs."""
    n, s = q.shape[2], cache.offset
    keys, values = bucket_buffers(cache)
    rows = bucket_rows(n)
    q = _pad_rows(q, rows)
    if buckets.kernel is None:
        mask = buckets.mask(s, n, rows, keys.shape[2])
        return matmul_attention(q, keys, values, scale, mask)[:, :, :n]
    weigh = lambda scores: buckets.softmax(scores, s, n, rows)  # noqa: E731
    return matmul_attention(q, keys, values, scale, weigh=weigh)[:, :, :n]


def _pad_rows(q: mx.array, rows: int) -> mx.array:
    """q [B, H, L, D] with zero query rows after its own, `rows` in all."""
    return mx.pad(q, [(0, 0), (0, 0), (0, rows - q.shape[2]), (0, 0)])


def bucketed_rows_attention(
    q: mx.array, cache: BatchKVCache, mask: mx.array, scale: float, buckets: Buckets
) -> mx.array:
    """A batch's attention of q [B, H, n, D] under the model's boolean mask [B, 1, n, S]
    (each row's causal columns, its left padding masked) at a bucketed shape: rows padded to
    `bucket_rows` (a padded row sees every real column; its output is dropped), columns to
    `bucket_buffers` (unused ones masked), as matmul attention under the padded mask."""
    n, s = q.shape[2], mask.shape[-1]
    keys, values = bucket_buffers(cache)
    rows = bucket_rows(n)
    if rows > n:
        seen = mx.ones((q.shape[0], 1, rows - n, s), dtype=mx.bool_)
        mask = mx.concatenate([mask, seen], axis=2)
    mask = mx.pad(mask, [(0, 0), (0, 0), (0, 0), (0, keys.shape[2] - s)])  # pads with False
    return matmul_attention(_pad_rows(q, rows), keys, values, scale, mask)[:, :, :n]


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

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        kind = type(cache)
        attend = None
        if kind is KVCache and _is_causal(mask) and self._bucketed(x, cache.offset + x.shape[1]):
            buckets, scale = self.buckets, self.attention.scale
            reserve(cache, x.shape[1])
            return self._attend(
                x, cache, lambda q, k, v: bucketed_attention(q, cache, scale, buckets)
            )
        if (
            kind is BatchKVCache
            and self.batches
            and _is_boolean(mask)
            and self._bucketed(x, mask.shape[-1])
        ):
            buckets, scale = self.buckets, self.attention.scale
            reserve(cache, x.shape[1])
            return self._attend(
                x, cache, lambda q, k, v: bucketed_rows_attention(q, cache, mask, scale, buckets)
            )
        if kind in (KVCache, DequantizingKVCache) and _is_causal(mask):
            attend = self._kernel(x, mask, cache.offset + x.shape[1])
        elif kind in (BatchKVCache, QuantizedRows) and _is_boolean(mask):
            attend = self._kernel(x, mask, mask.shape[-1])
        if attend is None:
            return self.attention(x, mask=mask, cache=cache)
        return self._attend(x, cache, attend)

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
        padded_keys = _whole_steps(keys) + KEY_STEP  # at most a step past
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
        if "q_norm" in a:
            q, k = a.q_norm(q), a.k_norm(k)
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
        return a.o_proj(out)


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
    elif layout[0] not in MODULES or layout[1] != "Attention":
        return False
    parts = LAYOUT if layout != UNROTATED else LAYOUT[:-1]
    if not all(name in attention for name in parts):
        return False
    if ("q_norm" in attention) != ("k_norm" in attention):
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
    masks = Buckets(kernel=on_cuda_gpu()) if dtype in HALF and attention_buckets() else None
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
