"""The rows kernel's CUDA code (`cuda_rows.py` launches it): each form's header and body, and
`kernel_body`, which states once per form what `mx.fast.cuda_kernel` is given and what
`outrider.testing.cuda_compile` compiles for the nvcc check."""

from __future__ import annotations

# In the kernel's name, which MLX's CUDA backend keys its compiled-code cache by (on disk, with
# the template arguments): a changed SOURCE must change it, or a machine would run the old code.
VERSION = 8

HEADER = """
template <typename T, int P>
__device__ __forceinline__ void load_floats(const T* p, float* out) {
  constexpr int BYTES = P * (int)sizeof(T);
  if constexpr (BYTES % 16 == 0) {
    constexpr int E = 16 / (int)sizeof(T);
#pragma unroll
    for (int v = 0; v < BYTES / 16; ++v) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < E; ++i) out[v * E + i] = static_cast<float>(e[i]);
    }
  } else if constexpr (BYTES == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < P; ++i) out[i] = static_cast<float>(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) out[i] = static_cast<float>(p[i]);
  }
}
"""

# x [..., K] (T, M rows in all), w [N, W] packed uint32 (W = K * BITS / 32), scales and
# biases [N, K / GS]; y [..., N]. Template: T, M, R (weight rows a warp), BITS, GS.
SOURCE = """
const int N = w_shape[0];
const int W = w_shape[1];
const int K = W * (32 / BITS);
const int G = scales_shape[1];
constexpr int PER = 32 / BITS;
constexpr uint32_t MASK = (1u << BITS) - 1u;
const int lane = threadIdx.x & 31;
const int n0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
if (n0 >= N) return;
float acc[R][M];
#pragma unroll
for (int r = 0; r < R; ++r) {
#pragma unroll
  for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
}
for (int j0 = lane * 4; j0 < W; j0 += 128) {
  uint4 q[R];
  float s[R], b[R];
  const int g = (j0 * PER) / GS;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t n = (size_t)min(n0 + r, N - 1);
    q[r] = *reinterpret_cast<const uint4*>(w + n * W + j0);
    s[r] = static_cast<float>(scales[n * G + g]);
    b[r] = static_cast<float>(biases[n * G + g]);
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int k0 = (j0 + t) * PER;
    float xv[M][PER];
#pragma unroll
    for (int m = 0; m < M; ++m) load_floats<T, PER>(x + (size_t)m * K + k0, xv[m]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t word = t == 0 ? q[r].x : t == 1 ? q[r].y : t == 2 ? q[r].z : q[r].w;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const float wt = fmaf(s[r], static_cast<float>((word >> (BITS * i)) & MASK), b[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = fmaf(wt, xv[m][i], acc[r][m]);
      }
    }
  }
}
#pragma unroll
for (int r = 0; r < R; ++r) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[r][m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    acc[r][m] = v;
  }
}
if (lane == 0) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (n0 + r < N) {
#pragma unroll
      for (int m = 0; m < M; ++m) y[(size_t)m * N + n0 + r] = static_cast<T>(acc[r][m]);
    }
  }
}
"""

# The tensor-core form, for 4-bit weights and half-precision activations: one warp computes 16
# weight rows against all (up to 8) input rows with mma.sync m16n8k16 (float32 accumulators),
# KW warps of a block splitting the input dimension and summing in shared memory in a fixed
# order. Each lane reads 16 bytes (32 values) of its two weight rows per step, with the next
# step's read issued before this step's products. Pairs of 4-bit values are turned into
# half-precision pairs with one mask-and-or (magic exponent: 128 + q in bfloat16, 1024 + q in
# float16), less the magic, times the scale plus the bias (one rounding to the activation type,
# as a tensor-core product of dequantized weights has it). The pairs are nibbles i and i + 4 of
# a word, so the input dimension is permuted inside each mma the same way for the weights and
# the inputs (a sum does not care about its order), with the inputs' pairs built by byte_perm.
# The rows of the product do not meet inside an mma (each output is its own sum), so a row is
# bit for bit the same whatever the number of rows.
MMA_HEADER = r"""
__device__ __forceinline__ uint32_t dequant_pair(uint32_t bits, uint32_t scale2, uint32_t bias2, __nv_bfloat16) {
  uint32_t p = (bits & 0x000F000Fu) | 0x43004300u, m = 0x43004300u;
  __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&p), *reinterpret_cast<__nv_bfloat162*>(&m));
  __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<__nv_bfloat162*>(&scale2), *reinterpret_cast<__nv_bfloat162*>(&bias2));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t dequant_pair(uint32_t bits, uint32_t scale2, uint32_t bias2, __half) {
  uint32_t p = (bits & 0x000F000Fu) | 0x64006400u, m = 0x64006400u;
  __half2 q = __hsub2(*reinterpret_cast<__half2*>(&p), *reinterpret_cast<__half2*>(&m));
  __half2 r = __hfma2(q, *reinterpret_cast<__half2*>(&scale2), *reinterpret_cast<__half2*>(&bias2));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t pair_of(T v) {
  const uint32_t b = *reinterpret_cast<const unsigned short*>(&v);
  return b | (b << 16);
}

// One 16-row tile of y = x @ dequantize(w).T (x [M, K], M <= 8 * NB; w [N, K / 8] packed
// 4-bit; scales, biases [N, K / GS]) by one block of KW warps; `part` is the block's shared
// scratch. Input rows go in NB groups of 8 (the mma's n): each step dequantizes its weights
// once and multiplies them with every group.
template <typename T, int GS, int KW, int NB, typename S>
__device__ __forceinline__ void rows_mma(
    const T* x, int M, int K, const uint32_t* w, const S* scales, const S* biases, T* y, int N,
    int tile, float (*part)[32][4 * NB]) {
const int W = K / 8;
const int G = K / GS;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int g = lane >> 2, t = lane & 3;
const int n0 = tile * 16;
const int ra = min(n0 + g, N - 1), rb = min(n0 + g + 8, N - 1);
const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)ra * W);
const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)rb * W);
const int steps = K / 128;
float c[NB][4];
#pragma unroll
for (int nb = 0; nb < NB; ++nb) {
  c[nb][0] = 0.f; c[nb][1] = 0.f; c[nb][2] = 0.f; c[nb][3] = 0.f;
}
const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
int st = warp;
// the packed words, scales and biases of step s for this lane's two rows (zeros past the end)
auto fetch = [&](int s, uint4& qa_, uint4& qb_, T& sa_, T& ba_, T& sb_, T& bb_) {
  qa_ = zero; qb_ = zero;
  sa_ = T(0.f); ba_ = T(0.f); sb_ = T(0.f); bb_ = T(0.f);
  if (s >= steps) return;
  const int v = s * 4 + t, grp = (v * 32) / GS;
  qa_ = wa[v]; qb_ = wb[v];
  sa_ = static_cast<T>(static_cast<float>(scales[(size_t)ra * G + grp]));
  ba_ = static_cast<T>(static_cast<float>(biases[(size_t)ra * G + grp]));
  sb_ = static_cast<T>(static_cast<float>(scales[(size_t)rb * G + grp]));
  bb_ = static_cast<T>(static_cast<float>(biases[(size_t)rb * G + grp]));
};
uint4 qa, qb;
T sa, ba, sb, bb;
fetch(st, qa, qb, sa, ba, sb, bb);
while (st < steps) {
  const int u = st * 4 + t;
  const int nx = st + KW;
  uint4 na, nb;
  T nsa, nba, nsb, nbb;
  fetch(nx, na, nb, nsa, nba, nsb, nbb);  // the next step's weights load during this one's math
  const uint32_t s2a = pair_of(sa), b2a = pair_of(ba), s2b = pair_of(sb), b2b = pair_of(bb);
  const uint32_t wordsa[4] = {qa.x, qa.y, qa.z, qa.w};
  const uint32_t wordsb[4] = {qb.x, qb.y, qb.z, qb.w};
  uint32_t a[8][4];  // this step's weights, dequantized once for every group of input rows
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a[2 * j + h][0] = dequant_pair(wordsa[j] >> (8 * h), s2a, b2a, T());
      a[2 * j + h][1] = dequant_pair(wordsb[j] >> (8 * h), s2b, b2b, T());
      a[2 * j + h][2] = dequant_pair(wordsa[j] >> (8 * h + 4), s2a, b2a, T());
      a[2 * j + h][3] = dequant_pair(wordsb[j] >> (8 * h + 4), s2b, b2b, T());
    }
  }
#pragma unroll
  for (int grp = 0; grp < NB; ++grp) {
    const int row = g + 8 * grp;
    uint32_t xw[16];
    if (row < M) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)row * K);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = xr[u * 4 + i];
        xw[4 * i] = v.x; xw[4 * i + 1] = v.y; xw[4 * i + 2] = v.z; xw[4 * i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) xw[i] = 0u;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t lo = xw[4 * j + h], hi = xw[4 * j + h + 2];
        mma16816(c[grp], a[2 * j + h], __byte_perm(lo, hi, 0x5410), __byte_perm(lo, hi, 0x7632), T());
      }
    }
  }
  qa = na; qb = nb; sa = nsa; ba = nba; sb = nsb; bb = nbb;
  st = nx;
}
#pragma unroll
for (int grp = 0; grp < NB; ++grp) {
#pragma unroll
  for (int i = 0; i < 4; ++i) part[warp][lane][4 * grp + i] = c[grp][i];
}
__syncthreads();
if (warp == 0) {
  const int na_ = n0 + g, nb_ = n0 + g + 8;
#pragma unroll
  for (int grp = 0; grp < NB; ++grp) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < KW; ++k) sum += part[k][lane][4 * grp + i];
      v[i] = sum;
    }
    const int m0 = 8 * grp + 2 * t, m1 = m0 + 1;
    if (na_ < N) {
      if (m0 < M) y[(size_t)m0 * N + na_] = static_cast<T>(v[0]);
      if (m1 < M) y[(size_t)m1 * N + na_] = static_cast<T>(v[1]);
    }
    if (nb_ < N) {
      if (m0 < M) y[(size_t)m0 * N + nb_] = static_cast<T>(v[2]);
      if (m1 < M) y[(size_t)m1 * N + nb_] = static_cast<T>(v[3]);
    }
  }
}
}

// The gemm form: the inputs are the mma's A operand (16 rows a fragment, read from shared
// memory with ldmatrix) and the dequantized weights its B operand (8 weight rows a fragment),
// so each warp computes MB x NT fragments of the output (16 MB input rows by 8 NT weight rows)
// from MB ldmatrix and NT weight fragments a k16 step: the inputs staged once a block, and
// each staged input read once a warp for NT weight fragments, not once a fragment. A block of
// KW warps computes 8 * NT * KW weight rows over the whole input width (no sum across warps),
// or, with KS > 1, over its share `split` of KS: then y is float32 [KS, M, N], the shares'
// partial sums, which SUM_SOURCE adds in order (a product with few weight rows, such as a 32B
// down projection's 5,120, has too few blocks to fill the GPU otherwise). The shares depend on
// K and KS only, so a row's sum runs in one order whatever the rows beside it.
//
// The k order inside each mma is the tensor-core form's (nibbles i and i + 4 of a packed word
// are one dequantized pair): each 16-byte input chunk is permuted into that order as it is
// staged (four byte_perms), so a weight's pairs need no shuffling. Shared memory holds a step's
// 128 input columns of each row as 16 segments of 16 bytes (combo c = 2j + h of the tensor-core
// form, then its low or high half of the mma's k), segment s of row r stored at s ^ (r & 7) so
// that an 8-row ldmatrix reads eight distinct bank groups.
template <typename T, int GS, int KW, int MB, int NT, int KS, typename S, typename O>
__device__ __forceinline__ void rows_gemm(
    const T* x, int M, int K, const uint32_t* w, const S* scales, const S* biases, O* y, int N,
    int block, int split, uint4* xs) {
constexpr int R = 16 * MB;                          // staged rows (zeros past M)
constexpr int CH = R * 16;                          // 16-byte chunks of a step's inputs
constexpr int PER = (CH + 32 * KW - 1) / (32 * KW);  // of them, a thread stages
const int W = K / 8;
const int G = K / GS;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int g = lane >> 2, t = lane & 3;
const int n0 = (block * KW + warp) * 8 * NT;
int rn[NT];
const uint4* wr[NT];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {
  rn[nt] = min(n0 + 8 * nt + g, N - 1);
  wr[nt] = reinterpret_cast<const uint4*>(w + (size_t)rn[nt] * W);
}
const int steps = K / 128;
// this block's share of the input width: steps s0 .. s1 - 1 (all of them unless KS > 1)
const int s0 = split * steps / KS, s1 = (split + 1) * steps / KS;
float c[MB][NT][4];
#pragma unroll
for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    c[mb][nt][0] = 0.f; c[mb][nt][1] = 0.f; c[mb][nt][2] = 0.f; c[mb][nt][3] = 0.f;
  }
}
const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
// a step's inputs, read into registers (the next step's, while this one's products run)
auto load_x = [&](int s, uint4* r) {
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int q = threadIdx.x + i * 32 * KW, row = q >> 4, cc = q & 15;
    r[i] = (q < CH && row < M)
        ? reinterpret_cast<const uint4*>(x + (size_t)row * K + (size_t)s * 128)[cc] : zero;
  }
};
// ...and into shared memory, permuted: chunk cc = 4 t' + j' of a row holds inputs
// 32 t' + 8 j' + o (o = 0..7); its pairs (o, o + 4) go to combo (j', o & 1 ? .. ) as below
auto store_x = [&](uint4* buf, const uint4* r) {
  uint32_t* b32 = reinterpret_cast<uint32_t*>(buf);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int q = threadIdx.x + i * 32 * KW, row = q >> 4, cc = q & 15;
    if (q >= CH) continue;
    const int tp = cc >> 2, jp = cc & 3, sw = row & 7;
    const uint4 v = r[i];
    const uint32_t pair[4] = {
        __byte_perm(v.x, v.z, 0x5410),  // (o0, o4): combo (j', 0), low half
        __byte_perm(v.x, v.z, 0x7632),  // (o1, o5): combo (j', 0), high half
        __byte_perm(v.y, v.w, 0x5410),  // (o2, o6): combo (j', 1), low half
        __byte_perm(v.y, v.w, 0x7632),  // (o3, o7): combo (j', 1), high half
    };
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int seg = 2 * (2 * jp + (p >> 1)) + (p & 1);
      b32[row * 64 + ((seg ^ sw) << 2) + tp] = pair[p];
    }
  }
};
auto fetch = [&](int s, uint4* q_, T* sc_, T* bi_) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) { q_[nt] = zero; sc_[nt] = T(0.f); bi_[nt] = T(0.f); }
  if (s >= s1) return;
  const int v = s * 4 + t, grp = (v * 32) / GS;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    q_[nt] = wr[nt][v];
    sc_[nt] = static_cast<T>(static_cast<float>(scales[(size_t)rn[nt] * G + grp]));
    bi_[nt] = static_cast<T>(static_cast<float>(biases[(size_t)rn[nt] * G + grp]));
  }
};
uint4 xr[PER];
load_x(s0, xr);
store_x(xs, xr);
uint4 wq[NT];
T sc[NT], bi[NT];
fetch(s0, wq, sc, bi);
__syncthreads();
// this lane's ldmatrix row: matrix i / 8 of the four, row i % 8 of it
const int lq = lane >> 3, lr = lane & 7;
for (int st = s0; st < s1; ++st) {
  uint4* cur = xs + ((st - s0) & 1) * R * 16;
  uint4* nxt = xs + ((st - s0 + 1) & 1) * R * 16;
  if (st + 1 < s1) load_x(st + 1, xr);
  uint4 nq[NT];
  T nsc[NT], nbi[NT];
  fetch(st + 1, nq, nsc, nbi);
  uint32_t s2[NT], b2[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) { s2[nt] = pair_of(sc[nt]); b2[nt] = pair_of(bi[nt]); }
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(cur);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int combo = 2 * j + h;
      uint32_t b[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t word = j == 0 ? wq[nt].x : j == 1 ? wq[nt].y : j == 2 ? wq[nt].z : wq[nt].w;
        b[nt][0] = dequant_pair(word >> (8 * h), s2[nt], b2[nt], T());
        b[nt][1] = dequant_pair(word >> (8 * h + 4), s2[nt], b2[nt], T());
      }
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        const int row = 16 * mb + lr + 8 * (lq & 1);
        const int seg = 2 * combo + (lq >> 1);
        const uint32_t addr = base + row * 256 + ((seg ^ lr) << 4);
        uint32_t a[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816(c[mb][nt], a, b[nt][0], b[nt][1], T());
      }
    }
  }
  if (st + 1 < s1) store_x(nxt, xr);
  __syncthreads();  // the next step's inputs are staged; this step's buffer is free again
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) { wq[nt] = nq[nt]; sc[nt] = nsc[nt]; bi[nt] = nbi[nt]; }
}
#pragma unroll
for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = n0 + 8 * nt + 2 * t, m0 = 16 * mb + g, m1 = m0 + 8;
    O* ys = y + (size_t)split * M * N;  // KS > 1: this share's partial sums, [KS, M, N]
    if (n < N) {
      if (m0 < M) ys[(size_t)m0 * N + n] = static_cast<O>(c[mb][nt][0]);
      if (m1 < M) ys[(size_t)m1 * N + n] = static_cast<O>(c[mb][nt][2]);
    }
    if (n + 1 < N) {
      if (m0 < M) ys[(size_t)m0 * N + n + 1] = static_cast<O>(c[mb][nt][1]);
      if (m1 < M) ys[(size_t)m1 * N + n + 1] = static_cast<O>(c[mb][nt][3]);
    }
  }
}
}
"""

# x [..., K] (T, M <= 8 * NB rows in all), w [N, K / 8] packed 4-bit, scales and biases
# [N, K / GS]; y [..., N].
# Template: T (bfloat16 or float16), GS, KW (warps a block, splitting K), NB (groups of 8 input
# rows). K % 128 == 0.
MMA_SOURCE = r"""
int M = 1;
for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
__shared__ float part[KW][32][4 * NB];
rows_mma<T, GS, KW, NB>(x, M, w_shape[1] * 8, w, scales, biases, y, w_shape[0], blockIdx.x, part);
"""

# The gemm form's body. Template: T, GS, KW (warps a block), MB (16-row fragments of inputs),
# NT (8-row fragments of weights a warp), KS (shares of the input width); a block computes
# 8 * NT * KW weight rows over one share.
GEMM_SOURCE = r"""
int M = 1;
for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
__shared__ uint4 xs[2 * 16 * 16 * MB];
rows_gemm<T, GS, KW, MB, NT, KS>(x, M, w_shape[1] * 8, w, scales, biases, y, w_shape[0],
                                 blockIdx.x / KS, blockIdx.x % KS, xs);
"""

# The sum of the gemm form's KS partial sums (part [KS, ...] float32), in order of share, as y
# [...] of type T.
SUM_SOURCE = r"""
int total = 1;
for (int d = 1; d < part_ndim; ++d) total *= part_shape[d];
const int i = blockIdx.x * blockDim.x + threadIdx.x;
if (i < total) {
  float s = part[i];
  for (int k = 1; k < KS; ++k) s += part[(size_t)k * total + i];
  y[i] = static_cast<T>(s);
}
"""


def group_source(count: int, form: str = "mma") -> str:
    """The grouped body of the tensor-core or gemm form for `count` matrices of one input width
    (inputs x, then w<i>, scales<i>, biases<i>; outputs y<i>): the launch's blocks run over
    the matrices' blocks of weight rows laid end to end, each block computing rows of one
    matrix, so a layer's q, k and v (or gate and up) take one launch where they took three
    (or two)."""
    scratch, span, call, params, smem = {
        "mma": ("float part[KW][32][4 * NB]", "16", "rows_mma", "NB", "part"),
        # a group's gemm blocks take the whole input width (one share: KS 1, share 0)
        "gemm": ("uint4 xs[2 * 16 * 16 * MB]", "8 * NT * KW", "rows_gemm", "MB, NT, 1", "0, xs"),
    }[form]
    lines = [
        "int M = 1;",
        "for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];",
        "const int K = x_shape[x_ndim - 1];",
        f"__shared__ {scratch};",
        "int tile = blockIdx.x;",
    ]
    for i in range(count):
        body = (
            f"{call}<T, GS, KW, {params}>(x, M, K, w{i}, scales{i}, biases{i}, y{i}, "
            f"w{i}_shape[0], tile, {smem});"
        )
        if i == count - 1:
            lines.append(body)
        else:
            blocks = f"(w{i}_shape[0] + {span} - 1) / ({span})"  # its blocks
            lines.append(f"if (tile < {blocks}) {{ {body} return; }}")
            lines.append(f"tile -= {blocks};")
    return "\n".join(lines) + "\n"


def kernel_body(form: str, count: int = 0) -> tuple[str, str, list, list]:
    """(header, source, inputs, outputs) of a form's kernel ("fma", "mma", "gemm",
    "gemm_split" and its "sum"; the grouped form for `count` matrices), each input and output as (name, type), the type
    "T" (the activations' and scales') or "uint32" (packed weights): what `mx.fast.cuda_kernel`
    is given, and what `outrider.testing.cuda_compile` compiles it from."""
    if count:
        triples = [(f"{a}{i}", "uint32" if a == "w" else "T") for i in range(count)
                   for a in ("w", "scales", "biases")]  # fmt: skip
        outputs = [(f"y{i}", "T") for i in range(count)]
        return MMA_HEADER, group_source(count, form), [("x", "T"), *triples], outputs
    if form == "sum":
        return "", SUM_SOURCE, [("part", "float32")], [("y", "T")]
    header, source = {
        "mma": (MMA_HEADER, MMA_SOURCE),
        "gemm": (MMA_HEADER, GEMM_SOURCE),
        "gemm_split": (MMA_HEADER, GEMM_SOURCE),  # y: the shares' float32 partial sums
    }.get(form, (HEADER, SOURCE))
    return (
        header,
        source,
        [("x", "T"), ("w", "uint32"), ("scales", "T"), ("biases", "T")],
        [("y", "float32" if form == "gemm_split" else "T")],
    )
