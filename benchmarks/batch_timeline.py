"""Where continuous batching's wall time goes: the same requests decoded B at a time (as
`Pipeline.generate_batch(max_batch=B)` and the server do) and one at a time, each pass split
into its prefills (`start_row`), joins, leaves and rounds (by the batch's width at that round).

`benchmarks/batch_throughput.py` says how much faster batching is; this says why it is not
faster still: whether the rounds at full width cost what `batch_round_phases.py` measures, or
the time goes to prefills, narrow rounds at the tail, or joining and leaving.

    python benchmarks/batch_timeline.py                              # demo pair, dspark, B = 8
    python benchmarks/batch_timeline.py --mode baseline --requests 32 --batch 8
    python benchmarks/batch_timeline.py --shape 0.6b --mode oracle   # random weights

`--shape` runs a random-weight Qwen3 of that shape on random prompts, in mode baseline or
oracle (`batch_throughput.py`'s, with its options' defaults: 128-token prompts, 80% a token).

A first batched pass (untimed) compiles every shape both passes meet, unless `--cold`.
A join's time includes computing the merged cache; a round right after a join is its own part
(the new row's prompt enters the drafter then). On a CUDA GPU, MLX_USE_CUDA_GRAPHS=0 runs both
passes without MLX's CUDA graphs (docs/performance.md, "MLX's CUDA graphs and batched rounds").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from functools import partial

import outrider  # noqa: F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx
from batch_throughput import suite_texts, timed  # this folder: its prompts, its timing


def arrays_of(cache, depth: int = 3) -> list[mx.array]:
    """Every array a batched cache holds (its layers' keys, values, offsets, states...)."""
    out: list[mx.array] = []

    def walk(value, left: int) -> None:
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, left)
        elif left and hasattr(value, "__dict__"):
            for item in vars(value).values():
                walk(item, left - 1)

    walk(list(cache), depth)
    return out


def batched_pass(pipe, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    """generate_batch's loop (at most `width` rows; the next prompt joins the round a row
    leaves), each part timed: prefills, joins (the merged cache computed, not left for the
    next round), rounds by width (the leaves inside a round, filtering the batched cache,
    count with it; a round right after a join apart, since the drafter takes the new row in
    then), and the text of each step."""
    batch = pipe.make_batch()
    waiting = list(prompts)[::-1]
    spent: dict[str, list[float]] = defaultdict(list)
    phases: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    collectors = {}
    tokens = 0
    t0 = time.perf_counter()

    joined = False  # a row joined since the last round

    def admit() -> None:
        nonlocal tokens, joined
        while waiting and len(batch) < width:
            ids = waiting.pop()
            start, s = timed(partial(pipe.start_row, ids, max_tokens=max_tokens, stop_tokens=set()))
            spent["prefill"].append(s)
            tokens += len(start.first.step.committed)
            if start.row is not None:
                collectors[id(start.row)] = start.collector
                _, s = timed(partial(join, start.row, start.cache))
                spent["join"].append(s)
                joined = True

    def join(row, cache) -> None:
        batch.join(row, cache)
        mx.eval(arrays_of(batch.cache))

    admit()
    while len(batch):
        rows = len(batch)
        steps, s = timed(batch.round)
        spent[f"round x{rows}" + (", after a join" if joined else "")].append(s)
        joined = False
        for name, seconds in (steps[0][1].phases or {}).items() if steps else ():
            phases[rows][name].append(seconds)
        t = time.perf_counter()
        for row, step in steps:  # the text of each step, as generate_batch does
            collectors[id(row)].add(step)
            tokens += len(step.committed)
        spent["text"].append(time.perf_counter() - t)
        admit()
    spent["total"] = [time.perf_counter() - t0]
    return {"spent": spent, "tokens": tokens, "phases": phases}


def single_pass(pipe, prompts: list[list[int]], max_tokens: int) -> dict:
    """The same requests one at a time (`generate`): prefills, rounds, plain steps."""
    spent: dict[str, list[float]] = defaultdict(list)
    tokens = plain = 0
    t0 = time.perf_counter()
    for ids in prompts:
        result, _ = timed(partial(pipe.generate, ids, max_tokens=max_tokens, stop_tokens=set()))
        spent["prefill"].append(result.prefill_seconds)
        spent["round x1"] += [r.seconds for r in result.rounds]
        # plain steps (auto's parked ones), one entry a request: decoding outside the rounds
        spent["plain (a request)"].append(
            result.decode_seconds - sum(r.seconds for r in result.rounds)
        )
        plain += result.plain_steps
        tokens += len(result.tokens)
    spent["total"] = [time.perf_counter() - t0]
    return {"spent": spent, "tokens": tokens, "plain steps": plain}


def table(name: str, run: dict) -> None:
    spent, total = run["spent"], run["spent"]["total"][0]
    print(f"\n{name}: {run['tokens']} tokens in {total:.3f} s = {run['tokens'] / total:.1f} tok/s"
          + (f", {run['plain steps']} plain steps" if "plain steps" in run else ""))  # fmt: skip
    print(f"  {'part':<24} {'count':>6} {'sum s':>8} {'share':>6} {'median ms':>10}")
    parts = sorted(
        (k for k in spent if k != "total" and spent[k]), key=lambda k: (k[:5], len(k), k)
    )
    accounted = 0.0
    for part in parts:
        values = spent[part]
        accounted += sum(values)
        print(f"  {part:<24} {len(values):>6} {sum(values):>8.3f} {sum(values) / total:>6.1%} "
              f"{statistics.median(values) * 1e3:>10.2f}")  # fmt: skip
    print(f"  {'elsewhere':<24} {'':>6} {total - accounted:>8.3f} {1 - accounted / total:>6.1%}")
    if run.get("phases"):  # inside each batched round (core/round.py verify_round), medians
        print("  rounds by width, median ms: launch (drafter + verify built and queued) | wait "
              "(the device) | after (accepting, rollback built, teaching)")  # fmt: skip
        for rows, parts in sorted(run["phases"].items()):
            cells = " | ".join(f"{k} {statistics.median(v) * 1e3:6.2f}" for k, v in parts.items())
            print(f"    x{rows:<3} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target (default: the embedded demo target)")
    ap.add_argument("--drafter")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--suite", default="code,math,chat")
    ap.add_argument("--cold", action="store_true", help="no untimed first pass")
    ap.add_argument("--shape", help="a random-weight qwen3 of this shape (0.6b, 8b) instead")
    ap.add_argument("--dtype", default="bf16", help="with --shape")
    args = ap.parse_args()
    if args.shape:
        from batch_throughput import random_target_pipes

        pipes, prompts = random_target_pipes(
            args.shape, args.dtype, [args.mode], args.requests, args.max_tokens
        )
        pipe, args.model = pipes[args.mode], f"qwen3-{args.shape}-{args.dtype} (random weights)"
    else:
        from outrider.demo import demo_target

        pipe = outrider.load(args.model or demo_target(), args.drafter, mode=args.mode)
        prompts = [pipe.encode(text) for text in suite_texts(args.suite, args.requests)]
    scheduler = "on" if pipe.batch_scheduler() is not None else "off"
    print(f"{args.model or 'demo pair'} · {args.mode} · B = {args.batch} · {len(prompts)} requests"
          f" · {args.max_tokens} tokens · batch scheduler {scheduler} · mlx {mx.__version__} "
          f"{mx.default_device()}")  # fmt: skip
    if not args.cold:
        batched_pass(pipe, prompts, args.batch, args.max_tokens)
        single_pass(pipe, prompts[:4], args.max_tokens)
    batched = batched_pass(pipe, prompts, args.batch, args.max_tokens)
    single = single_pass(pipe, prompts, args.max_tokens)
    table(f"batched, at most {args.batch} rows", batched)
    table("one at a time", single)
    b, s = batched["spent"]["total"][0], single["spent"]["total"][0]
    print(f"\nbatched / one at a time: {s / b:.2f}x")


if __name__ == "__main__":
    main()
