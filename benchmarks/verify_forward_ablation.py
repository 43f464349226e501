"""What a verify forward's width costs, and which part of the forward pays it.

Part 1 (forwards): a random-weight Qwen3 of a real shape; one forward of w rows at a context,
the key length growing by one between calls (as it does across rounds), with five attentions
(`--hows`): what loading chose (`native`: on a CUDA GPU outrider's rerouted attention, see
OUTRIDER_ATTENTION and OUTRIDER_ATTENTION_BUCKETS; MLX's own elsewhere), the same without the
fused attention kernels (`softmax`: bucketed attention around the softmax kernel; see
plugins/targets/fused_attention.py), outrider's matmul-softmax-matmul (`matmul`: `matmul_attention`, the query
heads of a KV head stacked as rows), the same with the keys broadcast over those heads instead
(`broadcast`, its form until 2026-12-04), and none at all (`none`: the projections, norms and
head alone; wrong logits, timing only). `uncompiled` is `native` with the layers' own path
in place of their compiled parts where loading compiled them (core/compiled_layers.py, a CUDA
GPU by default); `matmul`, `broadcast` and `none` run the layers' own path too. Median ms per
forward.

Part 2 (--sdpa): 36 layers' `mx.fast.scaled_dot_product_attention` alone with Qwen3-8B's heads
(32 query, 8 key/value, dim 128, bf16; `--heads` for others), the key length fixed or growing
between calls (`+g`): mask "causal", a boolean mask array, and one call per query row
(`split1`); with `--kinds`, also outrider's matmul attention (`matmul`), its first product
alone (`qk`) and that product with its mask and softmax (`qk+softmax`), to see which step a
long context's cost sits in. Median ms, and the first call's in brackets.

    python benchmarks/verify_forward_ablation.py --shape 8b --dtypes 4bit,bf16 --contexts 256,4224
    python benchmarks/verify_forward_ablation.py --shape 32b --dtypes bf16 --contexts 4224 \
        --widths 1,33,97  # a prefix hit's suffix forward (docs/server.md)
    python benchmarks/verify_forward_ablation.py --sdpa --contexts 4224 --widths 97 \
        --heads 64,8,64 --kinds causal,matmul,qk,qk+softmax  # where that attention's time goes
    python benchmarks/verify_forward_ablation.py --sdpa
    python benchmarks/verify_forward_ablation.py --shape 8b --dtypes bf16,4bit --contexts 256 \
        --widths 1,3,5,8 --hows native,uncompiled  # what compiled layers do to each width

Receipts (H200): docs/receipts/verify_forward_ablation_h200.txt,
docs/receipts/attention_key_lengths_h200.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask

from outrider.core import compiled_layers
from outrider.plugins.targets.attention_forms import (
    Buckets,
    bucketed_attention,
    chunked_causal_attention,
    matmul_attention,
)
from outrider.plugins.targets.verify_attention import ChunkedAttention

sys.path.insert(0, str(Path(__file__).parent))

WIDTHS = (1, 2, 5, 8, 16, 64)
HOWS = ("native", "uncompiled", "softmax", "broadcast", "matmul", "none")
BUCKETS: dict[Any, Any] = {}  # one per kind, as one per wrapped model


def broadcast_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Causal attention of the last n positions as two matmuls and a softmax, the keys
    broadcast over each KV head's query heads (outrider's `matmul_attention` until 2026-12-04;
    it now stacks those heads as rows instead)."""
    b, h, n, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    q = (q * scale).reshape(b, kv, h // kv, n, d)
    scores = q @ k[:, :, None].swapaxes(-1, -2)
    seen = mx.arange(s)[None] <= mx.arange(s - n, s)[:, None]
    scores = mx.where(seen, scores, mx.array(-float("inf"), scores.dtype))
    return (mx.softmax(scores, axis=-1, precise=True) @ v[:, :, None]).reshape(b, h, n, d)


class Ablated(nn.Module):
    """A Qwen3 attention whose multi-row calls use `matmul_attention`, or skip attention."""

    def __init__(self, attention: nn.Module, how: str) -> None:
        super().__init__()
        # the model's own attention, under the verify-attention wrapper loading put in front
        # of it on a GPU (whose q_norm and k_norm name the model's, not hold them)
        inner = attention.attention if isinstance(attention, ChunkedAttention) else attention
        self.attention, self.how = inner, how

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        a = self.attention
        b, n, _ = x.shape
        if n == 1 and self.how in ("matmul", "broadcast"):
            return a(x, mask=mask, cache=cache)
        q = a.q_norm(a.q_proj(x).reshape(b, n, a.n_heads, -1)).transpose(0, 2, 1, 3)
        k = a.k_norm(a.k_proj(x).reshape(b, n, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        if self.how == "none":
            out = q
        elif self.how == "broadcast":
            out = broadcast_attention(q, keys, values, a.scale)
        else:
            out = matmul_attention(q, keys, values, a.scale)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def forwards(
    shape: str,
    dtypes: list[str],
    contexts: list[int],
    reps: int,
    widths: tuple[int, ...] = WIDTHS,
    hows: tuple[str, ...] = HOWS,
) -> None:
    from loop_efficiency import make_target

    for dtype in dtypes:
        target = make_target(shape, dtype)
        # the layers themselves, behind any compiled parts (whose trace reads the attention's
        # projections, so every how but native and softmax runs the layers' own path)
        layers = [
            layer.layer if isinstance(layer, compiled_layers.CompiledLayer) else layer
            for layer in target.family.layers(target.model)
        ]
        own = [layer.self_attn for layer in layers]
        fused = {id(a.buckets): a.buckets.fused for a in own if getattr(a, "buckets", None)}
        for ctx in contexts:
            for how in hows:
                for layer, attention in zip(layers, own):
                    native = how in ("native", "uncompiled", "softmax")
                    layer.self_attn = attention if native else Ablated(attention, how)
                    kept = getattr(attention, "buckets", None)
                    if kept is not None:  # softmax: bucketed attention without fused kernels
                        kept.fused = None if how == "softmax" else fused[id(kept)]
                cache = target.make_cache()
                mx.eval(target.forward(mx.arange(10, 10 + ctx, dtype=mx.uint32), cache)[0])
                compiled = how in ("native", "softmax")
                layers_own = nullcontext if compiled else compiled_layers.bypassed
                with layers_own(target.model):
                    row = timed_widths(target, cache, widths, reps)
                print(f"{shape} {dtype} ctx {ctx} {how:10s}: " + "  ".join(row), flush=True)
        for layer, attention in zip(layers, own):
            layer.self_attn = attention


def timed_widths(target: Any, cache: Any, widths: tuple[int, ...], reps: int) -> list[str]:
    """Each width's median ms a forward over `cache`, the key length one more each call."""
    row = []
    for w in widths:
        times = []
        for r in range(reps):
            ids = mx.arange(100 + r, 100 + r + w, dtype=mx.uint32)
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(target.forward(ids, cache)[0])
            mx.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            target.rollback(cache, w - 1)  # one position more each call
        timed = times[1:] or times  # the first call builds kernels (and a width's trace)
        row.append(f"w{w} {median(timed):6.2f}")
    return row


def attention(kind: str, q: mx.array, k: mx.array, v: mx.array, s: int) -> mx.array:
    """One layer's attention of q over the first s keys, the way `kind` names."""
    n, scale = q.shape[2], q.shape[-1] ** -0.5
    k_all, v_all = k, v
    k, v = k[:, :, :s], v[:, :, :s]
    if kind in ("bucket", "bucket-where"):  # outrider's bucketed attention (verify_attention.py)
        cache = SimpleNamespace(keys=k_all, values=v_all, offset=s)
        kernel = kind == "bucket" and mx.default_device() == mx.gpu and mx.cuda.is_available()
        buckets = BUCKETS.setdefault(kernel, Buckets(kernel))
        return bucketed_attention(q, cache, scale, buckets)
    if kind == "fused":  # outrider's two CUDA kernels (fused_attention.py)
        from outrider.plugins.targets.fused_attention import FusedAttention

        fused = BUCKETS.setdefault("fused", FusedAttention())
        return fused(q, k_all, v_all, s, scale)
    if kind == "split1":
        return chunked_causal_attention(q, k, v, scale, chunk=1)
    if kind == "matmul":
        return matmul_attention(q, k, v, scale)
    if kind in ("qk", "qk+where", "qk+softmax"):  # matmul attention's first product, mask, softmax
        b, h, _, d = q.shape
        kv_heads = k.shape[1]
        scores = (q * scale).reshape(b, kv_heads, h // kv_heads * n, d) @ k.swapaxes(-1, -2)
        if kind == "qk":
            return scores
        scores = scores.reshape(b, kv_heads, h // kv_heads, n, s)
        scores = mx.where(create_causal_mask(n, offset=s - n), scores, -mx.inf)
        if kind == "qk+where":
            return scores
        return mx.softmax(scores, axis=-1, precise=True)
    mask = None if n == 1 else "causal" if kind == "causal" else create_causal_mask(n, s - n)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def sdpa(
    contexts: list[int],
    reps: int,
    widths: tuple[int, ...] = WIDTHS,
    kinds: tuple[str, ...] = ("causal", "array", "split1"),
    shape: tuple[int, int, int] = (32, 8, 36),
) -> None:
    heads, kv_heads, layers = shape
    dim = 128
    for s0 in contexts:
        room = -(-(s0 + 3 * reps) // 256) * 256  # a whole 256-step past the longest call
        k = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
        for n in widths:
            q = mx.random.normal((1, heads, n, dim)).astype(mx.bfloat16)
            cells = []
            want = attention("causal", q, k, v, s0).astype(mx.float32)
            for kind in kinds:
                got = attention(kind, q, k, v, s0)
                if got.shape == want.shape:  # the same attention, to bf16 rounding
                    wrong = mx.abs(got.astype(mx.float32) - want).max().item()
                    cells.append(f"{kind} |d| {wrong:.1e}")
                for step in (0, 3):  # the key length fixed, or 3 longer each rep
                    times = []
                    for r in range(reps):
                        mx.synchronize()
                        t0 = time.perf_counter()
                        mx.eval([attention(kind, q, k, v, s0 + step * r) for _ in range(layers)])
                        mx.synchronize()
                        times.append((time.perf_counter() - t0) * 1e3)
                    name = kind + ("+g" if step else "")
                    cells.append(f"{name} {median(times):6.2f} ({times[0]:.0f})")
            print(f"S {s0} L {n:3d}: " + " | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", help="random Qwen3 shape (0.6b, 8b, 32b)")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="rows per forward")
    ap.add_argument("--dtypes", default="4bit,bf16")
    ap.add_argument("--contexts", default="256,4224")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sdpa", action="store_true", help="part 2 instead: attention alone")
    ap.add_argument(
        "--hows",
        default=",".join(HOWS),
        help="part 1: native (what loading chose), broadcast, matmul, none",
    )
    ap.add_argument(
        "--kinds",
        default="causal,array,split1",
        help="part 2: causal, array, split1, matmul, fused, bucket, bucket-where (without the softmax "
        "kernel), qk (matmul's first product), qk+where, qk+softmax",
    )
    ap.add_argument(
        "--heads", default="32,8,36", help="part 2: query heads, KV heads, layers (32B: 64,8,64)"
    )
    args = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}")
    contexts = [int(c) for c in args.contexts.split(",")]
    widths = tuple(int(w) for w in args.widths.split(","))
    if args.sdpa:
        shape = tuple(int(x) for x in args.heads.split(","))
        sdpa(contexts, max(args.reps, 6), widths, tuple(args.kinds.split(",")), shape)
    else:
        hows = tuple(args.hows.split(","))
        forwards(args.shape, args.dtypes.split(","), contexts, args.reps, widths, hows)


if __name__ == "__main__":
    main()
