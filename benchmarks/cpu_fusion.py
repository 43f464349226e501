"""What fusing norms and ropes buys on MLX's CPU backend (core/cpu_fusion.py).

Loads the model twice, with `OUTRIDER_CPU_FUSION=off` and `on`, and runs plain decoding and
a drafting mode at a fixed cap on the same prompts, the arms interleaved (the order reversed
every pass), then prints each arm's median decode tokens per second over the passes (from the
first token on), the ratio, the
nodes of one decode step's graph, and whether every arm's output equals plain decoding's
unfused output (it must: the fused modules are bit-identical).

    python benchmarks/cpu_fusion.py --passes 3
    python benchmarks/cpu_fusion.py --model HuggingFaceTB/SmolLM2-135M-Instruct --mode lookup
"""

from __future__ import annotations

import argparse
import collections
import os
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

from outrider.api import Pipeline, load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core.cpu_fusion import FUSION_ENV  # noqa: E402

DRAFTERS = {"dspark": "outrider-demo/dspark", "dflash": "outrider-demo/dflash"}


def step_nodes(pipe: Pipeline) -> int:
    """Nodes of one decode step's graph (a one-token forward after a short prompt)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = pipe.target.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache))
    logits = model(mx.array([[7]]), cache=cache)
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), logits)
        return len(re.findall(r"shape=rectangle", dot.read_text()))


def run(pipe: Pipeline, prompts: list[list[int]], max_tokens: int, kw: dict) -> tuple:
    """Decode tokens per second over `prompts` (from each first token on: the prefill is not
    counted), and each prompt's tokens."""
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        out, first = [], None
        for chunk in pipe.stream(ids, max_tokens=max_tokens, stop_tokens=set(), **kw):
            if first is None:
                first = time.perf_counter()
            else:
                tokens += len(chunk.step.committed)
            out += chunk.step.committed
        seconds += time.perf_counter() - first
        outputs.append(out)
    return tokens / seconds, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--mode", default="dspark", help="the drafting arm (dspark, dflash, lookup)")
    ap.add_argument("--cap", type=int, default=4)
    ap.add_argument("--suite", default="code")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    if mx.default_device() != mx.cpu:
        sys.exit("cpu_fusion.py: MLX's default device is not the CPU; nothing is fused there")
    drafter = DRAFTERS.get(args.mode) if args.model == "outrider-demo/target" else None
    arms: dict[tuple[str, str], tuple[Pipeline, dict]] = {}
    for fusion in ("off", "on"):
        os.environ[FUSION_ENV] = fusion  # read when a model is loaded
        arms[(fusion, "baseline")] = (load(args.model, None, mode="baseline"), {})
        pipe = load(args.model, drafter, mode=args.mode)
        arms[(fusion, args.mode)] = (pipe, {"max_draft": args.cap})
    nodes = {fusion: step_nodes(arms[(fusion, "baseline")][0]) for fusion in ("off", "on")}
    base = arms[("off", "baseline")][0]
    prompts = [base.encode(p.text) for p in load_suite(args.suite)][: args.prompts]
    for pipe, kw in arms.values():  # warm-up: compiles and first shapes
        run(pipe, prompts[:1], 16, kw)
    rates: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    outputs: dict[tuple[str, str], list] = {}
    order = list(arms)
    for n in range(args.passes):
        for name in order if n % 2 == 0 else order[::-1]:
            pipe, kw = arms[name]
            rate, out = run(pipe, prompts, args.max_tokens, kw)
            rates[name].append(rate)
            outputs.setdefault(name, out)
    want = outputs[("off", "baseline")]
    print(
        f"{args.model}, {args.suite}, {len(prompts)} prompts x {args.passes} passes, "
        f"{args.max_tokens} tokens, MLX {mx.__version__} CPU"
    )
    print(f"  nodes of a decode step: {nodes['off']} unfused, {nodes['on']} fused")
    for mode in ("baseline", args.mode):
        off = statistics.median(rates[("off", mode)])
        on = statistics.median(rates[("on", mode)])
        cap = "" if mode == "baseline" else f" (cap {args.cap})"
        print(f"  {mode + cap:16s} {off:8.1f} tok/s unfused  {on:8.1f} fused  x{on / off:.3f}")
    same = all(out == want for out in outputs.values())
    print(f"  every arm's output equals unfused plain decoding's: {same}")


if __name__ == "__main__":
    main()
