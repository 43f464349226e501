"""MLX's primitives on this device against MLX's CPU backend, at the shapes of the test suite's
tiny models (head dim 16 and 64, a few query rows, 64-wide quantized layers).

A wrong kernel shows as a relative error near 1 (or a raise); float32 agrees to ~1e-7 with
MLX_ENABLE_TF32=0 and to ~1e-3 without it on CUDA, bfloat16 to a few 1e-3. Each line is printed
as it is measured: the first call of each shape can compile a kernel (a minute for a quantized
one on the H200), so --seconds bounds the run.

    MLX_ENABLE_TF32=0 python3 benchmarks/mlx_cuda_primitives.py --seconds 100
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np


def on_cpu(x: mx.array) -> mx.array:
    """A copy of `x` made on the host (bfloat16 through float32: numpy has no bfloat16)."""
    if x.dtype == mx.bfloat16:
        return mx.array(np.array(x.astype(mx.float32))).astype(mx.bfloat16)
    return mx.array(np.array(x))


def relative_error(got: mx.array, want: mx.array) -> str:
    a, b = (np.array(x.astype(mx.float32)) for x in (got, want))
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return f"non-finite (device {not np.isfinite(a).all()}, cpu {not np.isfinite(b).all()})"
    return f"{np.abs(a - b).max() / max(np.abs(b).max(), 1e-6):.3g}"


def checks() -> list[tuple[str, Callable, tuple]]:
    """(name, function, inputs) for every case: the ones in doubt first (the quantized products
    compile slowly), attention last (it agreed on the H200)."""
    out = []
    # a way around it: dequantize the cache's slices (both widths), then MLX's dense attention
    buffer = [mx.random.normal((1, 2, 256, 64)) for _ in range(2)]
    for bits in (4, 8):
        qk, qv = (mx.quantize(x, group_size=64, bits=bits) for x in buffer)
        kk, vv = ([_cached(a, 34, "sliced") for a in x] for x in (qk, qv))
        out.append((f"dequantize a cache slice, 34 keys {bits}-bit", _deq(64, bits), tuple(kk)))
        for rows in (1, 5, 34):
            q = mx.random.normal((1, 4, rows, 64))
            name = f"dense attention over dequantized slices, 34 keys {bits}-bit rows {rows}"
            out.append((name, _deq_sdpa(64, bits), (q, *kk, *vv)))
    # mlx-lm's quantized attention as its cache hands it the keys and values: two KV heads
    # (no broadcast), sliced out of the same 256-position buffer, or copied into their own memory
    qk, qv = (mx.quantize(x, group_size=64, bits=8) for x in buffer)
    for rows in (1, 5, 34):
        q = mx.random.normal((1, 2, rows, 64))
        p = mx.softmax(mx.random.normal((1, 2, rows, 34)), axis=-1)
        for how in ("sliced", "contiguous"):
            kk, vv = ([_cached(a, 34, how) for a in x] for x in (qk, qv))
            name = f"quantized attention over a cache, 34 keys ({how}) rows {rows}"
            out.append((f"{name}: scores", _qmm(64, 8), (q, *kk)))
            out.append((f"{name}: values", _qmm(64, 8, transpose=False), (p, *vv)))
    for bits in (8, 4):  # mlx-lm's attention over a quantized KV cache: q @ keys^T, batched
        keys = mx.random.normal((1, 2, 3, 64))
        packed, scales, biases = mx.quantize(keys, group_size=64, bits=bits)
        for dtype in (mx.float32, mx.bfloat16):
            q = mx.random.normal((1, 2, 3, 64)).astype(dtype)
            args = (q, packed, scales.astype(dtype), biases.astype(dtype))
            name = f"quantized attention scores 3x3x64x2 {bits}-bit {dtype}"
            out.append((name, _qmm(64, bits), args))
    # the same with grouped-query heads, as mlx-lm's quantized attention runs it: two query heads
    # share one KV head, whose keys and values broadcast over them (expand_dims), or repeated
    keys, values = mx.random.normal((1, 1, 3, 64)), mx.random.normal((1, 1, 3, 64))
    qk, qv = (mx.quantize(x, group_size=64, bits=8) for x in (keys, values))
    for dtype in (mx.float32, mx.bfloat16):
        q = mx.random.normal((1, 1, 2, 3, 64)).astype(dtype)
        p = mx.softmax(mx.random.normal((1, 1, 2, 3, 3)), axis=-1).astype(dtype)
        for how in ("broadcast", "repeated"):
            kk, vv = ([_heads(a, how).astype(dtype) if a.dtype != mx.uint32 else _heads(a, how)
                       for a in x] for x in (qk, qv))  # fmt: skip
            name = f"quantized attention, 2 query heads a KV head ({how}) 8-bit {dtype}"
            out.append((f"{name}: scores", _qmm(64, 8), (q, *kk)))
            out.append((f"{name}: values", _qmm(64, 8, transpose=False), (p, *vv)))
    for n_in, n_out in ((128, 512), (512, 128)):  # the Hadamard packs' MLP: float16 scales
        w = mx.random.normal((n_out, n_in))
        packed, scales, biases = mx.quantize(w, group_size=128, bits=2)
        for dtype in (mx.float32, mx.float16):
            for rows in (2, 8, 51):
                x = mx.random.normal((1, rows, n_in)).astype(dtype)
                args = (x, packed, scales.astype(mx.float16), biases.astype(mx.float16))
                name = f"quantized_matmul {n_out}x{n_in} 2-bit float16 scales {dtype} rows {rows}"
                out.append((name, _qmm(128, bits=2), args))
    out += [
        (f"hadamard float32 n{n}", mx.hadamard_transform, (mx.random.normal((3, n)),))
        for n in (16, 64, 512, 8192)  # 512 to 8192: the Hadamard packs' rotation blocks
    ]
    w = mx.random.normal((64, 64))
    for group in (64, 32):
        packed, scales, biases = mx.quantize(w, group_size=group, bits=4)
        for dtype in (mx.float32, mx.bfloat16):
            for rows in (1, 2, 8):
                x = mx.random.normal((rows, 64)).astype(dtype)
                args = (x, packed, scales.astype(dtype), biases.astype(dtype))
                name = f"quantized_matmul 64x64 group {group} {dtype} rows {rows}"
                out.append((name, _qmm(group), args))
    packed, scales, biases = mx.quantize(mx.random.normal((512, 128)), group_size=128, bits=2)
    for rows in (1, 2, 8):  # the Hadamard packs' 2-bit products, groups of 128
        x = mx.random.normal((rows, 128))
        name = f"quantized_matmul 512x128 2-bit group 128 float32 rows {rows}"
        out.append((name, _qmm(128, bits=2), (x, packed, scales, biases)))
    sdpa = mx.fast.scaled_dot_product_attention
    for d in (16, 64):
        for dtype in (mx.float32, mx.bfloat16):
            for rows, keys in ((1, 9), (2, 9), (5, 12), (8, 15)):
                k = mx.random.split(mx.random.key(d + rows), 3)
                q = mx.random.normal((1, 4, rows, d), key=k[0]).astype(dtype)
                kv = [mx.random.normal((1, 2, keys, d), key=x).astype(dtype) for x in k[1:]]
                band = mx.random.uniform(shape=(1, 1, rows, keys), key=k[0]) > 0.3
                band = band | (mx.arange(keys) == 0)
                additive = mx.where(band, 0.0, -1e9).astype(dtype)
                name = f"sdpa D{d} {dtype} rows {rows} keys {keys}"
                for label, mask in (("none", None), ("causal", "causal")):
                    out.append((f"{name} {label}", _sdpa(sdpa, d, mask), (q, *kv)))
                for label, mask in (("bool", band), ("additive", additive)):
                    out.append((f"{name} {label}", _sdpa_masked(sdpa, d), (q, *kv, mask)))
    # a DSpark head with per-head sinks that slides a window (NVIDIA's packaging), as
    # `DraftAttention` calls it: a batch of two rows, each with its own mask; one row unmasked;
    # and a block's rows folded into heads (one query each, the sinks repeated per row)
    for d in (16, 64):
        for dtype in (mx.float32, mx.bfloat16):
            for rows, keys in ((4, 13), (8, 20)):
                k = mx.random.split(mx.random.key(100 + d + rows), 4)
                q = mx.random.normal((2, 4, rows, d), key=k[0]).astype(dtype)
                kv = [mx.random.normal((2, 2, keys, d), key=x).astype(dtype) for x in k[1:3]]
                sinks = mx.random.normal((4,), key=k[3]).astype(dtype)
                window = mx.random.uniform(shape=(2, 1, rows, keys), key=k[3]) > 0.4
                window = window | (mx.arange(keys) == keys - 1)
                name = f"sdpa sinks D{d} {dtype} rows {rows} keys {keys}"
                args = (q, *kv, window, sinks)
                out.append((f"{name} batch 2 bool", _sdpa_sinks(sdpa, d), args))
                out.append((f"{name} unmasked", _sdpa_sinks(sdpa, d), (q, *kv, None, sinks)))
                out.append((f"{name} folded", _sdpa_sinks_folded(sdpa, d), (q, *kv, sinks)))
    return out


def _sdpa(sdpa: Callable, d: int, mask) -> Callable:
    return lambda q, k, v: sdpa(q, k, v, scale=d**-0.5, mask=mask)


def _sdpa_masked(sdpa: Callable, d: int) -> Callable:
    return lambda q, k, v, m: sdpa(q, k, v, scale=d**-0.5, mask=m)


def _sdpa_sinks(sdpa: Callable, d: int) -> Callable:
    return lambda q, k, v, m, s: sdpa(q, k, v, scale=d**-0.5, mask=m, sinks=s)


def _sdpa_sinks_folded(sdpa: Callable, d: int) -> Callable:
    def attend(q, k, v, s):
        b, h, n, _ = q.shape
        out = sdpa(q.reshape(b, h * n, 1, d), k, v, scale=d**-0.5, sinks=mx.repeat(s, n))
        return out.reshape(b, h, n, d)

    return attend


def _heads(a: mx.array, how: str) -> mx.array:
    """One KV head's array `a` [1, 1, n, d] for two query heads: broadcast (a size-1 axis, as
    mlx-lm's `expand_dims`) or repeated into its own memory."""
    a = mx.expand_dims(a, -3)
    return a if how == "broadcast" else mx.contiguous(mx.repeat(a, 2, axis=-3))


def _cached(a: mx.array, n: int, how: str) -> mx.array:
    """The first n positions of a cache buffer `a`: a slice (what mlx-lm's cache returns) or a
    copy of it in its own memory."""
    a = a[..., :n, :]
    return a if how == "sliced" else mx.contiguous(a)


def _deq(group: int, bits: int) -> Callable:
    return lambda w, s, b: mx.dequantize(w, s, b, group_size=group, bits=bits)


def _deq_sdpa(group: int, bits: int) -> Callable:
    """Four query heads over two KV heads (MLX's attention takes the grouping itself)."""

    def attend(q, kw, ks, kb, vw, vs, vb):
        k, v = _deq(group, bits)(kw, ks, kb), _deq(group, bits)(vw, vs, vb)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")

    return attend


def _qmm(group: int, bits: int = 4, transpose: bool = True) -> Callable:
    return lambda x, w, s, b: mx.quantized_matmul(
        x, w, s, b, transpose=transpose, group_size=group, bits=bits
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150, help="stop starting cases after")
    args = parser.parse_args()
    tf32 = os.environ.get("MLX_ENABLE_TF32", "1 (default)")
    print(f"mlx {mx.__version__} on {mx.default_device()}, MLX_ENABLE_TF32={tf32}", flush=True)
    stop = time.time() + args.seconds
    for name, fn, inputs in checks():
        if time.time() > stop:
            print("(time is up: the remaining cases were not run)")
            break
        start = time.time()
        try:
            got = fn(*inputs)
            mx.eval(got)
        except Exception as e:  # a shape the backend has no kernel for
            print(f"{name}: raises {str(e)[:200]}", flush=True)
            continue
        with mx.stream(mx.cpu):
            want = fn(*(None if x is None else on_cpu(x) for x in inputs))
            mx.eval(want)
        print(f"{name}: {relative_error(got, want)} ({time.time() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
