"""A verify's causal attention over a KV cache in two CUDA kernels of our own.

Bucketed attention (attention_forms.py) runs a half-precision verify's attention as MLX ops: pad
the query rows, scale them, a matmul, a masking softmax kernel, a second matmul, and a copy of
the result into the layout the output projection reads. On MLX's CUDA backend each launch costs
about 10 µs whatever it computes, and an 8B verify of a few rows spends most of its attention
time launching (docs/performance.md). Here the whole attention of up to 64 query vectors a KV
head (the query heads that share it, times the verify's rows) is two launches:

- `PARTS`: one block per (batch row, KV head, tile of TILE keys). The block holds its query
  vectors in shared memory, scaled; each key's thread pair computes that key's scores against
  them (a thread reads its key's row once, 16 bytes at a time), masked causally (row i of n over
  s keys sees keys up to s - n + i); each query vector's scores become exp(score - tile max) and
  their sum; then each thread, one dimension of the head, sums those weights times the values.
  It writes the tile's unnormalised output, maximum and sum, in float32.
- `COMBINE`: one block per (batch row, query head, row), a thread a dimension: the tiles'
  outputs rescaled to the largest maximum and divided by the total sum (the flash-decoding
  reduction), written as [B, n, H, D], so that the layer's transpose back to rows is a view.

Every sum runs in float32, as `mx.softmax(precise=True)` and MLX's attention kernels do; the
result agrees with MLX's own attention to the rounding of the activation type, which the load's
probe checks (verify_attention.install drops the kernels where it does not).
"""

from __future__ import annotations

import mlx.core as mx

# Keys a block takes; query vectors (heads sharing a KV head x rows) a block holds at most, and
# head dimensions it takes: its shared memory (query vectors and scores in float32) stays
# within the 48 KB a block may have without asking.
TILE = 64
MAX_VECTORS = 64
HEAD_DIMS = (64, 128)
# Keys (the cache's length) up to which the kernels run: one block per 64 keys, so the blocks
# and the partial outputs the combine reads grow with the context, and on an H100 (2026-12-05,
# docs/performance.md) they beat the softmax kernel's path at 256 and 1,024 keys, tied it at
# 2,048 and lost at 4,224.
MAX_KEYS = 2048
THREADS = 128
# In the kernels' names, which MLX's CUDA backend keys its compiled-code cache by (on disk): a
# changed source must change it, or a machine would run the old code.
VERSION = 1

# Inputs: q [B, H, n, D], k, v [B, Hkv, S, D] (T, row-contiguous), params int32 [s, n], scale
# float32 [1]. Outputs: part [B, H, n, splits, D], stat [B, H, n, splits, 2] (max, sum), float32.
# Template: T, D (head dim), QV (query vectors a block holds, >= H / Hkv * n).
PARTS = """
constexpr int TILE = 64;
constexpr int GROUPS = 128 / D;  // query-vector groups of the output step: 128 threads, D each
const int H = q_shape[1], Hkv = k_shape[1], S = k_shape[2];
const int s = params[0], n = params[1];
const int G = H / Hkv, qv = G * n;
const int splits = (s + TILE - 1) / TILE;
const int sp = blockIdx.x % splits, bh = blockIdx.x / splits;
const int b = bh / Hkv, kvh = bh % Hkv;
const int tid = threadIdx.x;
__shared__ float qs[QV][D];
__shared__ float sc[QV][TILE];  // with qs, 48 KB at QV 64 and D 128: a block's static limit

const float scale_ = scale[0];
for (int e = tid; e < qv * D; e += 128) {  // vector r = g * n + i: head kvh * G + g, row i
  const int r = e / D, d = e % D;
  const int g = r / n, i = r % n;
  qs[r][d] = static_cast<float>(q[(((size_t)b * H + kvh * G + g) * n + i) * D + d]) * scale_;
}
__syncthreads();

{  // scores: two threads a key, each taking every other query vector
  const int j = tid % TILE, half = tid / TILE;
  const int key = sp * TILE + j;
  float acc[QV / 2];
#pragma unroll
  for (int a = 0; a < QV / 2; ++a) acc[a] = 0.f;
  if (key < s) {
    const T* kr = k + (((size_t)b * Hkv + kvh) * S + key) * D;
#pragma unroll 4
    for (int d0 = 0; d0 < D; d0 += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(kr + d0);
      const T* e = reinterpret_cast<const T*>(&raw);
      float kf[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) kf[t] = static_cast<float>(e[t]);
#pragma unroll
      for (int a = 0; a < QV / 2; ++a) {
        const int r = 2 * a + half;
        if (r < qv) {
          float dot = 0.f;
#pragma unroll
          for (int t = 0; t < 8; ++t) dot += qs[r][d0 + t] * kf[t];
          acc[a] += dot;
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < QV / 2; ++a) {
    const int r = 2 * a + half;
    if (r < qv) {
      const int i = r % n;
      sc[r][j] = (key < s && key <= s - n + i) ? acc[a] : -INFINITY;
    }
  }
}
__syncthreads();

{  // each vector's tile maximum, weights exp(score - max) and their sum: a warp a vector
  const int warp = tid >> 5, lane = tid & 31;
  for (int r = warp; r < qv; r += 4) {
    const float a0 = sc[r][lane], a1 = sc[r][lane + 32];
    float m = fmaxf(a0, a1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    const float p0 = m == -INFINITY ? 0.f : expf(a0 - m);
    const float p1 = m == -INFINITY ? 0.f : expf(a1 - m);
    sc[r][lane] = p0;
    sc[r][lane + 32] = p1;
    float l = p0 + p1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffff, l, o);
    if (lane == 0) {
      const int g = r / n, i = r % n;
      const size_t row = ((size_t)b * H + kvh * G + g) * n + i;
      stat[(row * splits + sp) * 2] = m;
      stat[(row * splits + sp) * 2 + 1] = l;
    }
  }
}
__syncthreads();

{  // the weighted values: a thread a dimension, every GROUPS-th query vector
  const int d = tid % D, grp = tid / D;
  float o[QV / GROUPS];
#pragma unroll
  for (int a = 0; a < QV / GROUPS; ++a) o[a] = 0.f;
  const int here = min(TILE, s - sp * TILE);
  const T* vb = v + (((size_t)b * Hkv + kvh) * S + (size_t)sp * TILE) * D + d;
  for (int jj = 0; jj < here; ++jj) {
    const float vv = static_cast<float>(vb[(size_t)jj * D]);
#pragma unroll
    for (int a = 0; a < QV / GROUPS; ++a) {
      const int r = a * GROUPS + grp;
      if (r < qv) o[a] += sc[r][jj] * vv;
    }
  }
#pragma unroll
  for (int a = 0; a < QV / GROUPS; ++a) {
    const int r = a * GROUPS + grp;
    if (r < qv) {
      const int g = r / n, i = r % n;
      const size_t row = ((size_t)b * H + kvh * G + g) * n + i;
      part[(row * splits + sp) * D + d] = o[a];
    }
  }
}
"""

# Inputs: part, stat (PARTS' outputs). Output: y [B, n, H, D] (T). Template: T, D.
COMBINE = """
const int H = part_shape[1], n = part_shape[2], splits = part_shape[3];
const int row = blockIdx.x;  // (b * H + h) * n + i
const int d = threadIdx.x;
const float* st = stat + (size_t)row * splits * 2;
float top = -INFINITY;
for (int t = 0; t < splits; ++t) top = fmaxf(top, st[2 * t]);
float total = 0.f, acc = 0.f;
const float* pr = part + (size_t)row * splits * D + d;
for (int t = 0; t < splits; ++t) {
  const float m = st[2 * t];
  if (m == -INFINITY) continue;  // a tile wholly past this row's last key
  const float w = expf(m - top);
  total += w * st[2 * t + 1];
  acc += w * pr[(size_t)t * D];
}
const int b = row / (H * n), h = (row / n) % H, i = row % n;
y[(((size_t)b * n + i) * H + h) * D + d] = static_cast<T>(acc / total);
"""


class FusedAttention:
    """The two kernels, and what their calls share within a forward (the parameters of the
    forward's key count and rows, built once for all layers)."""

    def __init__(self) -> None:
        self._parts = mx.fast.cuda_kernel(
            f"outrider_attention_parts_v{VERSION}",
            input_names=["q", "k", "v", "params", "scale"],
            output_names=["part", "stat"],
            source=PARTS,
        )
        self._combine = mx.fast.cuda_kernel(
            f"outrider_attention_combine_v{VERSION}",
            input_names=["part", "stat"],
            output_names=["y"],
            source=COMBINE,
        )
        self._key: tuple[int, int] | None = None
        self._params: mx.array | None = None
        self._scales: dict[float, mx.array] = {}

    @staticmethod
    def takes(q: mx.array, keys: mx.array, s: int) -> bool:
        """Whether the kernels compute q [B, H, n, D]'s attention over the first s of keys
        [B, Hkv, S, D]: a half-precision head of 64 or 128 dimensions, at most MAX_VECTORS
        query vectors a KV head, at most MAX_KEYS keys."""
        b, h, n, d = q.shape
        return (
            q.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == q.dtype
            and d in HEAD_DIMS
            and h % keys.shape[1] == 0
            and h // keys.shape[1] * n <= MAX_VECTORS
            and s <= MAX_KEYS
        )

    def __call__(
        self, q: mx.array, keys: mx.array, values: mx.array, s: int, scale: float
    ) -> mx.array:
        """Causal attention of q [B, H, n, D] over the first s of keys, values [B, Hkv, S, D]
        (the last n of those s are the queries' own): [B, H, n, D], a view of [B, n, H, D]."""
        b, h, n, d = q.shape
        vectors = h // keys.shape[1] * n
        qv = 16 if vectors <= 16 else 32 if vectors <= 32 else MAX_VECTORS
        splits = -(-s // TILE)
        if self._key != (s, n):
            self._key, self._params = (s, n), mx.array([s, n], dtype=mx.int32)
        if scale not in self._scales:
            self._scales[scale] = mx.array([scale], dtype=mx.float32)
        part, stat = self._parts(
            inputs=[q, keys, values, self._params, self._scales[scale]],
            template=[("T", q.dtype), ("D", d), ("QV", qv)],
            grid=(b * keys.shape[1] * splits * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(b, h, n, splits, d), (b, h, n, splits, 2)],
            output_dtypes=[mx.float32, mx.float32],
        )
        y = self._combine(
            inputs=[part, stat],
            template=[("T", q.dtype), ("D", d)],
            grid=(b * h * n * d, 1, 1),
            threadgroup=(d, 1, 1),
            output_shapes=[(b, n, h, d)],
            output_dtypes=[q.dtype],
        )[0]
        return y.transpose(0, 2, 1, 3)
