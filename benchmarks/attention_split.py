"""Native vs split attention on this machine: the kernels alone, the whole target forward, and
how many primitives each graph holds.

MLX's CUDA backend runs fused attention only for fewer than 4 query rows. outrider splits a
verify's causal attention into chunks of at most 3 rows (plugins/targets/verify_attention.py)
and folds a drafter block's unmasked rows into extra heads of one query row
(plugins/strategies/block_drafter.py). This script measures both choices side by side,
interleaved repeat by repeat so a noisy host hits both alike, and checks they agree.

    python benchmarks/attention_split.py                   # the demo pair
    python benchmarks/attention_split.py --model M --drafter D --reps 60
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from outrider.api import load  # noqa: E402
from outrider.core.proposer import DraftContext  # noqa: E402
from outrider.core.sampling import SamplingParams  # noqa: E402
from outrider.plugins.targets.attention_forms import chunked_causal_attention  # noqa: E402
from outrider.plugins.targets.verify_attention import ChunkedAttention  # noqa: E402
from outrider.testing import cast_model  # noqa: E402


def interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median ms of build + eval per function, the functions taking turns each repeat."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + 3):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn(i))
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def primitives(*arrays) -> tuple[int, str]:
    """How many primitives the graph behind `arrays` holds, and the most common five."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        names = re.findall(r'\[label ="(\w+)", shape=rectangle', path.read_text())
    common = collections.Counter(names).most_common(5)
    return len(names), ", ".join(f"{k} {v}" for k, v in common)


def kernels(reps: int, dtype: mx.Dtype) -> None:
    print(f"\nattention alone (4 q heads, 2 kv heads, head 64, {dtype}), keys 300 + i")
    k_all = mx.random.normal((1, 2, 700, 64)).astype(dtype)
    v_all = mx.random.normal((1, 2, 700, 64)).astype(dtype)
    mx.eval(k_all, v_all)
    scale = 0.125
    for w in (1, 3, 5, 8):
        q = mx.random.normal((1, 4, w, 64)).astype(dtype)
        mask = None if w == 1 else "causal"

        def native(i, q=q, mask=mask):
            n = 300 + i
            return mx.fast.scaled_dot_product_attention(
                q, k_all[:, :, :n], v_all[:, :, :n], scale=scale, mask=mask
            )

        def split(i, q=q):
            n = 300 + i
            return chunked_causal_attention(q, k_all[:, :, :n], v_all[:, :, :n], scale)

        def unmasked(i, q=q):
            n = 300 + i
            return mx.fast.scaled_dot_product_attention(
                q, k_all[:, :, :n], v_all[:, :, :n], scale=scale
            )

        def folded(i, q=q, w=w):
            n = 300 + i
            f = q.reshape(1, 4 * w, 1, 64)
            out = mx.fast.scaled_dot_product_attention(
                f, k_all[:, :, :n], v_all[:, :, :n], scale=scale
            )
            return out.reshape(1, 4, w, 64)

        def fixed(i, q=q, mask=mask):  # one key length throughout: what a cache can reuse
            return mx.fast.scaled_dot_product_attention(
                q, k_all[:, :, :300], v_all[:, :, :300], scale=scale, mask=mask
            )

        fns = {"causal native": native}
        if w > 1:
            fns |= {"causal split": split, "unmasked native": unmasked, "unmasked folded": folded}
            fns |= {"causal native, fixed keys": fixed}
        t = interleaved(fns, reps)
        diff_c = mx.abs(native(0) - split(0)).max().item() if w > 1 else 0.0
        diff_u = mx.abs(unmasked(0) - folded(0)).max().item() if w > 1 else 0.0
        cells = "  ".join(f"{k} {v:6.3f}" for k, v in t.items())
        print(f"  w{w}  {cells}   |diff| causal {diff_c:.1e} unmasked {diff_u:.1e}")


def set_split(layers: list, on: bool) -> None:
    for layer in layers:
        attn = layer.self_attn
        if on and not isinstance(attn, ChunkedAttention):
            layer.self_attn = ChunkedAttention(attn, half=True)
        if not on and isinstance(attn, ChunkedAttention):
            layer.self_attn = attn.attention


def forwards(pipe, reps: int, dtype: mx.Dtype) -> None:
    target = pipe.target
    layers = [getattr(x, "layer", x) for x in target.family.layers(target.model)]
    prompt = pipe.encode("Write a Python function that returns the n-th Fibonacci number.")
    cache = target.make_cache()
    with mx.stream(target.stream):
        target.prefill(prompt * 8, cache)
        mx.eval([c.state for c in cache])
        print(
            f"\nwhole target forward ({dtype}), cache from {cache[0].offset} tokens, one row "
            "longer each call as in decoding (build + eval, ms)"
        )
        for w in (1, 5, 8):
            ids = mx.array(list(range(3, 3 + w)), dtype=mx.uint32)

            def run(i, on, ids=ids, w=w):
                set_split(layers, on)
                out = target.forward(ids, cache)[0]
                mx.eval(out)
                target.rollback(cache, w - 1)
                return out

            t = interleaved(
                {"native": lambda i: run(i, False), "split": lambda i: run(i, True)}, reps
            )
            set_split(layers, False)
            ref = target.forward(ids, cache)[0]
            n_native = primitives(ref)
            mx.eval(ref)
            target.rollback(cache, w)
            set_split(layers, True)
            got = target.forward(ids, cache)[0]
            n_split = primitives(got)
            mx.eval(got)
            target.rollback(cache, w)
            diff = mx.abs(ref - got).max().item()
            print(
                f"  w{w}  native {t['native']:6.3f} ({n_native[0]} prims)  "
                f"split {t['split']:6.3f} ({n_split[0]} prims)  max |Δlogit| {diff:.1e}"
            )
            if w == 5:
                print(f"      native: {n_native[1]}\n      split:  {n_split[1]}")


def proposals(pipe, reps: int) -> None:
    target, proposer = pipe.target, pipe.proposer
    attn = [layer.self_attn for layer in proposer.drafter.layers]
    tap_ids = tuple(proposer.tap_layer_ids)
    prompt = pipe.encode("Write a Python function that returns the n-th Fibonacci number.")
    cache = target.make_cache()
    with mx.stream(target.stream):
        _, taps = target.prefill(prompt, cache, tap_ids)
        mx.eval(taps)
        print(f"\n{proposer.name} proposal, cap 4 (build + eval, ms)")

        def run(i, fold):
            for a in attn:
                a.fold_rows = fold
            proposer.start(prompt, taps[:-1])
            proposer.propose(DraftContext(prompt, 4, SamplingParams(), None))
            proposer.observe(0, taps[-1:])  # one new context row, as a round gives
            return proposer.propose(DraftContext(prompt, 4, SamplingParams(), None)).tokens

        t = interleaved(
            {"unfolded": lambda i: run(i, False), "folded": lambda i: run(i, True)}, reps
        )
        print(f"  two proposals: unfolded {t['unfolded']:6.3f}  folded {t['folded']:6.3f}")
        for fold in (False, True):
            for a in attn:
                a.fold_rows = fold
            proposer.start(prompt, taps)
            n, common = primitives(
                proposer.propose(DraftContext(prompt, 4, SamplingParams(), None)).tokens
            )
            print(f"  {'folded' if fold else 'unfolded'}: {n} primitives ({common})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter", default="outrider-demo/dspark")
    ap.add_argument("--dflash-drafter", default="outrider-demo/dflash")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="cast the target to this dtype first (default: as stored)",
    )
    args = ap.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}; medians of {args.reps}")
    kernels(args.reps, mx.float32)
    kernels(args.reps, mx.bfloat16)
    base = load(args.model, mode="baseline")
    dtype = mx.float32
    if args.dtype:
        dtype = getattr(mx, args.dtype)
        cast_model(base.target.model, dtype)
    forwards(base, args.reps, dtype)
    for drafter in (args.drafter, args.dflash_drafter):
        if drafter:
            proposals(load(args.model, drafter, target=base.target), args.reps)


if __name__ == "__main__":
    main()
