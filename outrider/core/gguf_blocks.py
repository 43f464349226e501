"""GGML's quantized blocks as MLX affine triples (packed codes, scales, biases; group size 32).

Each GGML type stores a row in blocks, and most of them are, per 32 weights, an affine map of
unsigned codes: Q8_0 (d · q, q signed), Q4_0 and Q5_0 (d · (q − 8), d · (q − 16)), Q4_1 and
Q5_1 (d · q + m), and the K-quants' super-blocks of 256 with eight sub-blocks of 32, Q4_K and
Q5_K (d·sc · q − dmin·m, with 6-bit sc and m per sub-block). Those map onto MLX's affine
quantization (w = scale · q + bias, groups of 32) code for code: the model keeps the file's bits
and dequantizes what llama.cpp does. MLX keeps scales and biases in float16, as its own GGUF
reader does; for the 32-weight types that is exact, and a K-quant's products d·sc and dmin·m are
rounded to float16 (a relative 2^-11 at most, far inside the quantization step).

Q6_K has sixteen 16-weight sub-blocks of signed 8-bit scales, which no group size MLX has
(32, 64, 128) can hold exactly: it is dequantized by gguf-py (llama.cpp's own reader) and
quantized again at 8 bits per group of 32 (minimum to maximum), each weight within about half
an 8-bit step, an eighth of the coarser of its group's two Q6_K steps.

Block layouts: llama.cpp `ggml/src/ggml-common.h` (`block_q4_K`, `block_q5_K`, ...) and the
dequantize routines of `ggml/src/ggml-quants.c`; gguf-py's `gguf/quants.py` implements the same
in numpy, and the tests check every type against it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .errors import CheckpointError

GROUP_SIZE = 32
# bits in MLX (not in the file), and GGML's block: (weights, bytes)
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 8}
BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24)}
BLOCK.update({"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)})


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (the trailing axis holds their two bytes) as float32."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return raw & 0xF, raw >> 4


def _q8_0(b: np.ndarray):
    d = _f16(b[..., 0:2])
    q = b[..., 2:34].view(np.int8).astype(np.int16) + 128  # signed codes as unsigned
    return q.astype(np.uint8), d, -128 * d


def _q4_0(b: np.ndarray):
    d = _f16(b[..., 0:2])
    low, high = _nibbles(b[..., 2:18])  # weights 0-15 in the low nibbles, 16-31 in the high
    return np.concatenate([low, high], axis=-1), d, -8 * d


def _q4_1(b: np.ndarray):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    low, high = _nibbles(b[..., 4:20])
    return np.concatenate([low, high], axis=-1), d, m


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: bit j of the little-endian 32-bit qh is the fifth bit of weight j."""
    return (np.ascontiguousarray(qh)[..., None] >> np.arange(8, dtype=np.uint8)) & 1


def _q5_0(b: np.ndarray):
    d = _f16(b[..., 0:2])
    low, high = _nibbles(b[..., 6:22])
    codes = np.concatenate([low, high], axis=-1) | (
        _fifth_bits(b[..., 2:6]).reshape(*b.shape[:-1], 32) << 4
    )
    return codes, d, -16 * d


def _q5_1(b: np.ndarray):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    low, high = _nibbles(b[..., 8:24])
    codes = np.concatenate([low, high], axis=-1) | (
        _fifth_bits(b[..., 4:8]).reshape(*b.shape[:-1], 32) << 4
    )
    return codes, d, m


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs a K-quant super-block packs into 12 bytes."""
    s = s.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray, codes: np.ndarray):
    """Q4_K / Q5_K: per sub-block of 32, scale d·sc and bias −dmin·m."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    return codes, d[..., None] * sc, -(dmin[..., None] * mn)


def _q4_k(b: np.ndarray):
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # four chunks of 64 weights
    low, high = _nibbles(qs)  # a chunk's first 32 weights in the low nibbles, the next in high
    codes = np.stack([low, high], axis=-2).reshape(*b.shape[:-1], 256)
    return _k_affine(b, codes)


def _q5_k(b: np.ndarray):
    qh = b[..., 16:48]  # bit j of byte l: the fifth bit of weight l of sub-block j
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low, high = _nibbles(qs)
    codes = np.stack([low, high], axis=-2).reshape(*b.shape[:-1], 8, 32)
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    codes = codes | (fifth << 4)
    return _k_affine(b, codes.reshape(*b.shape[:-1], 256))


def _q6_k_values(raw: np.ndarray) -> np.ndarray:
    import gguf  # llama.cpp's reader: its numpy dequantization of Q6_K

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)


def _eight_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group of 32, the 8-bit affine fit from the group's minimum to its maximum, its scale
    and bias rounded to float16 first so the codes fit what MLX will compute: every value
    within about half a step (1/510 of its group's range)."""
    rows, cols = values.shape
    groups = values.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    bias = low.astype(np.float16)
    scale = ((high - bias.astype(np.float32)) / 255).astype(np.float16)
    step = np.where(scale > 0, scale.astype(np.float32), 1.0)[..., None]
    codes = np.rint((groups - bias.astype(np.float32)[..., None]) / step)
    return np.clip(codes, 0, 255).astype(np.uint8).reshape(rows, cols), scale, bias


DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1}
DECODERS.update({"Q4_K": _q4_k, "Q5_K": _q5_k})


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [rows, cols] in MLX's packing: a little-endian bit stream per row, in
    uint32 words."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    # 32 codes fill `bits` whole words: code i starts at bit bits * i, and one that crosses a
    # word's end carries its high bits into the next
    groups = codes.reshape(codes.shape[0], -1, 32)
    words = np.zeros((*groups.shape[:-1], bits), np.uint32)
    for i in range(32):
        code = groups[..., i].astype(np.uint32)
        at, shift = divmod(bits * i, 32)
        words[..., at] |= code << np.uint32(shift)
        if shift + bits > 32:
            words[..., at + 1] |= code >> np.uint32(32 - shift)
    return words.reshape(codes.shape[0], -1)


def affine_triple(
    qtype: str, raw: np.ndarray, shape: tuple[int, ...], name: str
) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, scales, biases) in MLX's affine layout, group size 32, `BITS[qtype]` bits, of a
    tensor of `shape` stored as `raw` bytes of GGML type `qtype`."""
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    per_block, nbytes = BLOCK[qtype]
    if cols <= 0 or cols % per_block:  # gguf.check refuses such a file first
        raise CheckpointError(
            f"{name} is {qtype}, whose rows hold whole blocks of {per_block} weights, but its "
            f"rows have {cols}"
        )
    blocks = raw.reshape(rows, cols // per_block, nbytes)
    if qtype == "Q6_K":
        codes, scales, biases = _eight_bits(_q6_k_values(blocks.reshape(rows, -1)))
        w = mx.array(pack(codes, 8))
        scales, biases = mx.array(scales), mx.array(biases)
    else:
        codes, scales, biases = DECODERS[qtype](blocks)
        w = mx.array(pack(codes.reshape(rows, cols), BITS[qtype]))
        scales = mx.array(scales.reshape(rows, cols // GROUP_SIZE))
        biases = mx.array(biases.reshape(rows, cols // GROUP_SIZE))
    out_shape = (*shape[:-1], w.shape[-1])
    groups = (*shape[:-1], cols // GROUP_SIZE)
    return (
        w.reshape(out_shape),
        scales.astype(mx.float16).reshape(groups),
        biases.astype(mx.float16).reshape(groups),
    )
