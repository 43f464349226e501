"""Attention computed other ways than one call of MLX's fused kernel, over arrays and KV
caches (plugins/targets/verify_attention.py chooses where each runs): a verify's rows in causal
chunks the fused kernel takes, matmul attention (plain matmuls, mask and softmax, no kernel of
which depends on the lengths), and bucketed attention.

Bucketed attention pays for new shapes once per 256 keys instead of on every call: at 97 rows
over 4,224 keys with the 32B shape's heads in bf16, matmul attention took 18 ms over 64 layers
at a fixed key length and 31-34 ms with the key length growing (MLX's CUDA backend prepares
its work per shape), and one row per kernel call cost 0.5-1 ms a row for an 8B verify
(`benchmarks/verify_forward_ablation.py --sdpa`, docs/performance.md, "Bucketed attention").
Query rows are padded to `bucket_rows` (8, 16, then multiples of 16), keys to the cache's
buffer, a whole number of KEY_STEP (mlx-lm's own growth step; laid so before the update where
the buffer is too short, `reserve`, and re-laid once where a restore left it otherwise,
`bucket_buffers`), and the call runs as matmul attention under a causal mask that gives every
padded key weight exactly zero, so padded rows and keys never reach a real row's output. On a
CUDA GPU the mask and softmax are one kernel of our own (`CAUSAL_SOFTMAX`, through
`mx.fast.cuda_kernel`) that reads the scores once and computes each row's mask from its
index, instead of `mx.where` and `mx.softmax` reading and writing the whole score matrix twice:
at that shape 11.8 ms against 25 ms, and 2.3-2.5 ms against 4.3-7.1 ms (one row per call) for
an 8B verify of 5-8 rows at 4k keys. (cuDNN's fused kernel takes 3.8 ms at a shape whose graph
it has built, but a mask array, which bucketed shapes need, took it to 18 ms, and every new
shape costs a 40-60 ms build.)
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from .fused_attention import FusedAttention

# Query rows per kernel call in a verify: MLX's CUDA vector kernel takes up to 3 float32 rows,
# and one row in half precision.
CHUNK = {mx.float32: 3}
# Bucketed shapes: keys padded to a multiple of KEY_STEP (mlx-lm KVCache's growth step), query
# rows to BUCKET_ROWS or a multiple of 16 (`bucket_rows`).
KEY_STEP = 256
BUCKET_ROWS = 8


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


def whole_steps(length: int) -> int:
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
        _lay_out(cache, whole_steps(_used(cache) + n))


def bucket_buffers(cache: KVCache | BatchKVCache) -> tuple[mx.array, mx.array]:
    """`cache`'s key and value buffers (after its update), their length a multiple of KEY_STEP
    less than two steps past the columns in use (`_used`). Where it is not (a restored prefix,
    a growth from a length off the step, a batch's rows filtered), the columns in use are
    re-laid into buffers of the next multiple, which the cache keeps: mlx-lm's caches write
    into their buffers in place and read only the columns in use, so longer buffers hold the
    same cache."""
    s, length = _used(cache), cache.keys.shape[2]
    if length % KEY_STEP or length - s >= 2 * KEY_STEP:
        _lay_out(cache, whole_steps(s))
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
    and write the whole score matrix twice; `kernel`), and with `fused` too the two kernels of
    `FusedAttention` for a verify's few rows."""

    def __init__(self, kernel: bool = False, fused: bool = False) -> None:
        self._key: tuple[int, int, int, int] | None = None
        self._mask: mx.array | None = None
        self._params: mx.array | None = None
        self.kernel = None  # the CUDA softmax kernel, or None for MLX's own ops
        self.fused: FusedAttention | None = None  # the whole attention in two CUDA kernels
        if kernel:
            try:  # compiled at its first call (the load's probe, which drops a failing route)
                self.kernel = mx.fast.cuda_kernel(
                    "outrider_causal_softmax",
                    input_names=["scores", "params"],
                    output_names=["weights"],
                    source=CAUSAL_SOFTMAX,
                )
                self.fused = FusedAttention() if fused else None
            except Exception:  # an MLX build without custom CUDA kernels: MLX's own ops
                self.kernel = self.fused = None

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
    bucketed shape: by `Buckets.fused` where it runs and takes q (two kernels, no padding);
    else rows padded to `bucket_rows`, keys to `bucket_buffers`, as matmul attention under
    `Buckets.mask`, or around `Buckets.softmax` where that kernel runs."""
    n, s = q.shape[2], cache.offset
    keys, values = bucket_buffers(cache)
    if buckets.fused is not None and buckets.fused.takes(q, keys, s):
        return buckets.fused(q, keys, values, s, scale)
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
