"""Emulates the index arithmetic of cuda_rows.py's gemm form (the staging permutation, the swizzle,
ldmatrix's rows, the mma fragments, the output pairs, the shares of the input width and their sum
in order) in float64 on the CPU, and checks that it computes x @ dequantize(w).T. It re-states the kernel's formulas, so it checks the layout, not the
CUDA source: a change to one must be made to the other.

    python scripts/emulate_rows_gemm.py
"""

import mlx.core as mx
import numpy as np

M, N, K, GS = 37, 72, 384, 64
KW, MB, NT = 2, 3, 2
KS = 2  # shares of the input width (3 steps: shares of 1 and 2)
rng = np.random.default_rng(0)
x = rng.standard_normal((M, K))
w = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05)
wq, sc, bi = mx.quantize(w, group_size=GS, bits=4)
wq, sc, bi = (
    np.array(wq).astype(np.uint32),
    np.array(sc, dtype=np.float64),
    np.array(bi, dtype=np.float64),
)
wd = np.array(
    mx.dequantize(
        mx.array(wq), mx.array(sc.astype(np.float32)), mx.array(bi.astype(np.float32)), GS, 4
    ),
    dtype=np.float64,
)
R = 16 * MB
W = K // 8
G = K // GS
steps = K // 128
part = np.zeros((KS, M, N))  # each share's partial sums (float32 in the kernel)
nblocks = -(-N // (8 * NT * KW))


def nib(word, shift):
    return (int(word) >> shift) & 0xF


def dequant_pair(word, shift, scale, bias):  # nibbles at bits shift..+3 and shift+16..+19
    return (nib(word, shift) * scale + bias, nib(word, shift + 16) * scale + bias)


for block, split in ((b, k) for b in range(nblocks) for k in range(KS)):
    s0, s1 = split * steps // KS, (split + 1) * steps // KS
    y = part[split]
    # staging: smem[row][seg_stored][word t'] = (lo, hi)
    for warp in range(KW):
        n0 = (block * KW + warp) * 8 * NT
        c = np.zeros((MB, NT, 32, 4))  # per lane
        for st in range(s0, s1):
            smem = np.zeros((R, 16, 4, 2))
            for row in range(R):
                for cc in range(16):
                    v = (
                        x[row, st * 128 + cc * 8 : st * 128 + cc * 8 + 8]
                        if row < M
                        else np.zeros(8)
                    )
                    tp, jp, sw = cc >> 2, cc & 3, row & 7
                    pairs = [(v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])]
                    for p in range(4):
                        seg = 2 * (2 * jp + (p >> 1)) + (p & 1)
                        smem[row, seg ^ sw, tp] = pairs[p]
            for j in range(4):
                for h in range(2):
                    combo = 2 * j + h
                    # B fragments: lane (g, t) -> b[nt][0], b[nt][1]
                    B = np.zeros((NT, 16, 8))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for nt in range(NT):
                            rn = min(n0 + 8 * nt + g, N - 1)
                            v = st * 4 + t
                            word = wq[rn, 4 * v + j]
                            grp = (v * 32) // GS
                            s_, b_ = sc[rn, grp], bi[rn, grp]
                            b0 = dequant_pair(word, 8 * h, s_, b_)
                            b1 = dequant_pair(word, 8 * h + 4, s_, b_)
                            B[nt, 2 * t, g], B[nt, 2 * t + 1, g] = b0
                            B[nt, 2 * t + 8, g], B[nt, 2 * t + 9, g] = b1
                    for mb in range(MB):
                        # ldmatrix: lane i addresses row of matrix i // 8
                        addr = {}
                        for lane in range(32):
                            lq, lr = lane >> 3, lane & 7
                            row = 16 * mb + lr + 8 * (lq & 1)
                            seg = 2 * combo + (lq >> 1)
                            addr[(lq, lr)] = (row, seg ^ lr)
                        A = np.zeros((16, 16))
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            regs = []
                            for q in range(4):
                                row, sseg = addr[(q, g)]
                                regs.append(smem[row, sseg, t])
                            A[g, 2 * t], A[g, 2 * t + 1] = regs[0]
                            A[g + 8, 2 * t], A[g + 8, 2 * t + 1] = regs[1]
                            A[g, 2 * t + 8], A[g, 2 * t + 9] = regs[2]
                            A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9] = regs[3]
                        for nt in range(NT):
                            C = A @ B[nt]
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                c[mb, nt, lane] += [
                                    C[g, 2 * t],
                                    C[g, 2 * t + 1],
                                    C[g + 8, 2 * t],
                                    C[g + 8, 2 * t + 1],
                                ]
        for mb in range(MB):
            for nt in range(NT):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    n, m0 = n0 + 8 * nt + 2 * t, 16 * mb + g
                    m1 = m0 + 8
                    cc4 = c[mb, nt, lane]
                    if n < N:
                        if m0 < M:
                            y[m0, n] = cc4[0]
                        if m1 < M:
                            y[m1, n] = cc4[2]
                    if n + 1 < N:
                        if m0 < M:
                            y[m0, n + 1] = cc4[1]
                        if m1 < M:
                            y[m1, n + 1] = cc4[3]
y = part[0].copy()
for k in range(1, KS):  # SUM_SOURCE: the shares added in order
    y += part[k]
want = x @ wd.T
print("max abs err", np.abs(y - want).max(), "scale", np.abs(want).max())
