"""Would compiling a decoder layer's blocks make a one-row step cheaper for the host?

On MLX's CUDA backend a one-row step is the host's time (benchmarks/plain_step.py: the device
waited 2-5 µs a step on an H100; the 8B's step was 2.4 ms of Python building the graph and
4.5 ms of MLX encoding and launching kernels). `mx.compile` replays a traced block from C++
instead of Python, op by op, and fuses its elementwise runs into fewer kernels. The KV cache
update and the attention over a growing cache change shape every step, so they stay eager;
everything else in a Qwen3 layer has one shape for every one-row step:

- `pre(x, offset)`: the input norm, the q/k/v projections, the q/k norms and both ropes (the
  position an array input, so one trace serves every step);
- `tail(x, attention)`: the output projection, the residual, the post-attention norm, the MLP
  and its residual.

Two arms on the same random-weight mlx-lm Qwen3 (no outrider wrappers), interleaved trial by
trial: the model as mlx-lm runs it, and the same model with every layer running `pre` and
`tail` compiled. Each arm is a pipelined one-row loop whose steps are split into graph building,
`mx.async_eval` and the wait for the token. The arms' greedy tokens must agree (the table says
where they part; in half precision a fused kernel may round an intermediate differently, so
a parting is checked against the logits' top two).

`--merged` adds a third arm that also runs q/k/v as one product and gate/up as one (their
weights joined along the output axis), for fewer kernels a layer.

outrider's own version is core/compiled_layers.py (the layers of a loaded target, on by default
on CUDA GPUs); this script measures the bare model, without outrider's wrappers.

    python benchmarks/compiled_blocks.py --shape 8b --dtype 4bit --merged
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from outrider.core.compiled_layers import Positions  # noqa: E402
from outrider.testing import build_model  # noqa: E402


class CompiledBlocks(nn.Module):
    """One mlx-lm Qwen3 decoder layer with its static-shape blocks compiled (see above);
    `projections` (h -> q, k, v before the head split) and `mlp` stand in for the layer's own."""

    def __init__(self, layer: nn.Module, positions: Positions, projections=None, mlp=None) -> None:
        super().__init__()
        self.layer = layer
        self._positions = positions  # one a model: every layer of a step reads the same array
        a, rope = layer.self_attn, layer.self_attn.rope
        projections = projections or (lambda h: (a.q_proj(h), a.k_proj(h), a.v_proj(h)))
        mlp = mlp or layer.mlp

        def pre(x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            b, n, _ = x.shape
            q, k, v = projections(layer.input_layernorm(x))
            q = a.q_norm(q.reshape(b, n, a.n_heads, -1)).transpose(0, 2, 1, 3)
            k = a.k_norm(k.reshape(b, n, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = v.reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            turn = dict(traditional=rope.traditional, base=rope.base, scale=rope.scale)
            q = mx.fast.rope(q, rope.dims, offset=offset, **turn)
            k = mx.fast.rope(k, rope.dims, offset=offset, **turn)
            return q, k, v

        def tail(x: mx.array, o: mx.array) -> mx.array:
            b, n, _ = x.shape
            h = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))
            return h + mlp(layer.post_attention_layernorm(h))

        self._pre, self._tail = mx.compile(pre), mx.compile(tail)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a = self.layer.self_attn
        q, k, v = self._pre(x, self._positions(cache.offset))
        k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=a.scale, mask=mask)
        return self._tail(x, o)


def merged_linear(*parts: nn.Module):
    """One product for sibling projections of the same input (q/k/v; gate/up): their weights
    joined along the output axis, plain or quantized alike (same bits and groups)."""
    if isinstance(parts[0], nn.QuantizedLinear):
        first = parts[0]
        w, s, b = (mx.concatenate([m[k] for m in parts]) for k in ("weight", "scales", "biases"))
        mx.eval(w, s, b)

        def product(x: mx.array) -> mx.array:
            return mx.quantized_matmul(
                x, w, scales=s, biases=b, transpose=True, group_size=first.group_size,
                bits=first.bits, mode=first.mode,
            )  # fmt: skip

        return product
    w = mx.concatenate([m.weight for m in parts])
    mx.eval(w)
    return lambda x: x @ w.T


class MergedBlocks(CompiledBlocks):
    """`CompiledBlocks` with q/k/v in one product and gate/up in one (fewer kernels a layer)."""

    def __init__(self, layer: nn.Module, positions: Positions) -> None:
        a, mlp = layer.self_attn, layer.mlp
        qkv = merged_linear(a.q_proj, a.k_proj, a.v_proj)
        gate_up = merged_linear(mlp.gate_proj, mlp.up_proj)
        # output rows (a quantized weight packs its input axis, not these)
        nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
        hidden = mlp.gate_proj.weight.shape[0]

        def projections(h: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            h = qkv(h)
            return h[..., :nq], h[..., nq : nq + nk], h[..., nq + nk :]

        def merged_mlp(h: mx.array) -> mx.array:
            g = gate_up(h)
            return mlp.down_proj(nn.silu(g[..., :hidden]) * g[..., hidden:])

        super().__init__(layer, positions, projections, merged_mlp)


def make_model(shape: str, dtype: str, compiled: bool | str, seed: int = 0):
    from loop_efficiency import qwen3_config

    half = None if dtype == "fp32" else mx.bfloat16
    model = build_model(qwen3_config(shape), seed=seed, scale=1.0, dtype=half)
    if dtype == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    if compiled:
        layers = model.model.layers
        kind = MergedBlocks if compiled == "merged" else CompiledBlocks
        positions = Positions()
        for i, layer in enumerate(layers):
            layers[i] = kind(layer, positions)
    return model


def steps(model, prompt: list[int], n: int):
    """A pipelined one-row loop: (seconds a step, tokens, {part: seconds a step}, logits)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    y = mx.argmax(logits)
    mx.eval(y)
    parts: dict[str, list[float]] = {"build": [], "launch": [], "wait": []}
    gaps, tokens, rows = [], [y.item()], []

    def step(y: mx.array) -> tuple[mx.array, mx.array]:
        row = model(y.reshape(1, 1), cache=cache)[0, -1]
        return mx.argmax(row), row

    nxt, row = step(y)
    mx.async_eval(nxt)
    y = nxt
    for _ in range(n - 1):
        t0 = time.perf_counter()
        nxt, following = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        tokens.append(y.item())
        t3 = time.perf_counter()
        rows.append(row)
        row = following
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[name].append(dt)
        gaps.append(t3 - t0)
        y = nxt
    tokens.append(y.item())
    return gaps, tokens, parts, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", help="loop_efficiency.py's shapes (tiny, 0.6b, 8b…)")
    ap.add_argument("--dtype", default="4bit", help="bf16, 4bit or fp32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--merged", action="store_true", help="a third arm: q/k/v and gate/up merged")
    args = ap.parse_args()
    models = {
        "mlx-lm": make_model(args.shape, args.dtype, False),
        "compiled": make_model(args.shape, args.dtype, True),
    }
    if args.merged:
        models["merged"] = make_model(args.shape, args.dtype, "merged")
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    for model in models.values():  # warm-up: kernels compiled, blocks traced
        steps(model, prompt, 8)
    names = list(models)
    gaps: dict[str, list[float]] = {name: [] for name in names}
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    got: dict[str, tuple[list[int], list[mx.array]]] = {}
    for trial in range(args.trials):
        turn = trial % len(names)
        for name in names[turn:] + names[:turn]:
            g, toks, p, rows = steps(models[name], prompt, args.tokens)
            gaps[name].append(statistics.median(g))
            for k, v in p.items():
                parts[name].setdefault(k, []).append(statistics.median(v))
            got.setdefault(name, (toks, rows))
    print(f"{args.shape} {args.dtype}: {args.trials} trials x {args.tokens} one-row steps, "
          f"prompt {args.prompt_len} tokens")  # fmt: skip
    first = statistics.median(gaps[names[0]])
    for name in names:
        med = statistics.median(gaps[name])
        paired = statistics.median(a / b for a, b in zip(gaps[names[0]], gaps[name]))
        split = "  ".join(
            f"{k} {statistics.median(v) * 1e6:7.1f} us" for k, v in parts[name].items()
        )
        print(
            f"  {name:9s} median {med * 1e3:7.3f} ms a step ({first / med:5.3f}x mlx-lm;"
            f" paired {paired:5.3f}x)  {split}"
        )
    want, rows = got["mlx-lm"]
    for name in names[1:]:
        tokens = got[name][0]
        apart = next((i for i, (a, b) in enumerate(zip(want, tokens)) if a != b), None)
        if apart is None:
            print(f"  {name} tokens: the same {len(want)}")
            continue
        top = mx.sort(rows[apart - 1].astype(mx.float32))[-2:].tolist() if apart else None
        print(f"  {name} tokens part at step {apart} ({want[apart]} against {tokens[apart]}); "
              f"mlx-lm's top two logits there: {top}")  # fmt: skip


if __name__ == "__main__":
    main()
