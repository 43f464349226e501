"""Where a plain decoding step's time goes: mlx-lm's loop against outrider's, part by part.

On the H200 outrider's plain decoding ran 7% behind mlx-lm's on the same model (8B shape, both
dtypes; docs/performance.md, "On the H200 again"). Both drive the same model object, wrappers
and all, so the gap is in what surrounds the forward. Four arms, interleaved trial by trial
(each first in turn), each `--tokens` steps after the same prompt:

- `mlx-lm`: `mlx_lm.generate.generate_step` on the target's model;
- `model`: a bare pipelined loop calling the model as mlx-lm does (`model(y[None])`, argmax);
- `target`: the same loop through `Target.forward` and the loop's `choose`, on the target's
  stream (what `loop._plain_steps` does per step, without the generator around it);
- `outrider`: the baseline pipeline (`Pipeline.stream`), as `outrider generate` runs it;
- `uncompiled`: the same with the target's own layers where it has compiled ones
  (core/compiled_layers.py; `mlx-lm` always runs its own);
- `tapped` (with `--taps`): the `target` loop forwarding those tap layers too, each step's taps
  kept unevaluated as a parked run hands them to its drafter (`parked.plain_run`).

For the two bare loops it splits a step into building the graph (Python), `mx.async_eval`
(MLX encodes and launches the kernels) and the wait for the token (`.item()`): where the wait
is near zero the step is bound by the host, and every microsecond of Python counts.

    python benchmarks/plain_step.py --model outrider-demo/target
    python benchmarks/plain_step.py --shape 8b --dtype 4bit
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

from outrider.core.compiled_layers import bypassed  # noqa: E402
from outrider.core.round import choose  # noqa: E402
from outrider.core.sampling import SamplingParams  # noqa: E402
from outrider.core.wrapper import routes  # noqa: E402
from outrider.plugins.strategies.baseline import PlainProposer  # noqa: E402

GREEDY = SamplingParams()


def mlx_lm_arm(target, prompt: list[int], n: int) -> tuple[list[float], list[int], dict]:
    from mlx_lm.generate import generate_step

    gaps, tokens, last = [], [], None
    with bypassed(target.model):  # mlx-lm's own layers
        for tok, _ in generate_step(mx.array(prompt), target.model, max_tokens=n):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens.append(int(tok))
    return gaps, tokens, {}


def bare_arm(target, prompt: list[int], n: int, through_target: bool, taps: tuple = ()):
    """A pipelined loop with each part of a step timed."""
    cache = target.make_cache()
    logits, _ = target.forward(mx.array(prompt, dtype=mx.uint32), cache)
    y = mx.argmax(logits[-1])
    mx.eval(y)
    model = target.model

    held: list[mx.array] = []  # a parked run's taps, as the drafter keeps them

    def step(y: mx.array) -> mx.array:
        with mx.stream(target.stream):
            if through_target:
                logits, tapped = target.forward(y.reshape(1).astype(mx.uint32), cache, taps)
                if tapped is not None:
                    held.append(tapped)
                return choose(logits[-1], GREEDY, None)
            return mx.argmax(model(y.reshape(1, 1), cache=cache)[0, -1])

    parts: dict[str, list[float]] = {"build": [], "launch": [], "wait": []}
    gaps, tokens = [], [y.item()]
    nxt = step(y)
    mx.async_eval(nxt)
    y = nxt
    for _ in range(n - 1):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        tokens.append(y.item())
        t3 = time.perf_counter()
        parts["build"].append(t1 - t0)
        parts["launch"].append(t2 - t1)
        parts["wait"].append(t3 - t2)
        gaps.append(t3 - t0)
        y = nxt
    tokens.append(y.item())
    mx.eval(held)
    return gaps, tokens, parts


def pipeline_arm(target, prompt: list[int], n: int) -> tuple[list[float], list[int], dict]:
    pipe = outrider.pipeline_from_parts(target, PlainProposer(), "baseline", max_draft=0)
    gaps, tokens, last = [], [], None
    for chunk in pipe.stream(prompt, max_tokens=n, stop_tokens=set()):
        now = time.perf_counter()
        if last is not None and chunk.tokens:
            gaps.append(now - last)
        if chunk.tokens:
            last = now
        tokens.extend(chunk.tokens)
    return gaps, tokens, {}


def uncompiled_arm(target, prompt: list[int], n: int) -> tuple[list[float], list[int], dict]:
    with bypassed(target.model):
        return pipeline_arm(target, prompt, n)


ARMS = {
    "mlx-lm": mlx_lm_arm,
    "model": lambda t, p, n: bare_arm(t, p, n, False),
    "target": lambda t, p, n: bare_arm(t, p, n, True),
    "outrider": pipeline_arm,
    "uncompiled": uncompiled_arm,
}


def tapped_arm(taps: tuple):
    return lambda t, p, n: bare_arm(t, p, n, True, taps)


def load_target(args):
    if args.model:
        from outrider.api import load

        return load(args.model, None, mode="baseline").target
    from loop_efficiency import make_target

    return make_target(args.shape, args.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model to load (else a random --shape)")
    ap.add_argument("--shape", default="8b", help="loop_efficiency.py's shapes")
    ap.add_argument("--dtype", default="4bit", help="bf16, 4bit or fp32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--taps", default="", help="tap layer ids (e.g. 1,2,3,4,5): a `tapped` arm")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    taps = tuple(int(j) for j in args.taps.split(",") if j.strip())
    if taps:
        ARMS["tapped"] = tapped_arm(taps)
        arms.append("tapped")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"no arm named {', '.join(unknown)} (choose from {', '.join(ARMS)})")
    target = load_target(args)
    if taps:
        target.install_taps(taps)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    for name in arms:  # warm-up: compiles every kernel each arm meets
        ARMS[name](target, prompt, 16)
    gaps: dict[str, list[float]] = {a: [] for a in arms}
    parts: dict[str, dict[str, list[float]]] = {a: {} for a in arms}
    outputs: dict[str, list[int]] = {}
    for trial in range(args.trials):
        turn = trial % len(arms)
        for name in arms[turn:] + arms[:turn]:
            g, toks, p = ARMS[name](target, prompt, args.tokens)
            gaps[name].append(statistics.median(g))
            for k, v in p.items():
                parts[name].setdefault(k, []).append(statistics.median(v))
            outputs.setdefault(name, toks[: args.tokens])
    what = args.model or f"{args.shape} {args.dtype}"
    print(f"{what}: {args.trials} trials x {args.tokens} steps, prompt {args.prompt_len} tokens"
          f" (layer routes: {routes(target.model)})")  # fmt: skip
    first = statistics.median(gaps[arms[0]])
    ref = outputs[arms[0]]
    for name in arms:
        med = statistics.median(gaps[name])
        split = "  ".join(
            f"{k} {statistics.median(v) * 1e6:7.1f} us" for k, v in parts[name].items()
        )
        same = "" if outputs[name] == ref else "  (tokens differ from the first arm's)"
        # each trial's ratio to the first arm's run of the same trial, which ran beside it:
        # drift of the host between trials cancels
        paired = statistics.median(a / b for a, b in zip(gaps[arms[0]], gaps[name]))
        print(f"  {name:9s} median {med * 1e3:7.3f} ms a step ({first / med:5.3f}x {arms[0]};"
              f" paired {paired:5.3f}x)  {split}{same}")  # fmt: skip


if __name__ == "__main__":
    main()
