"""Where a batched round's time goes, phase by phase, at one row and at B rows.

`batch_throughput.py` says how fast a batch decodes; this says why a round of B rows costs
what it does against a round of one. It starts B rows of the demo pair (or `--model`) on a
suite's prompts, as `Pipeline.generate_batch` does, then runs the batch's rounds itself with a
sync after each phase:

* propose: the drafter's proposals for every row (`propose_all`), graph built, then evaluated;
* verify build: the target's forward of every row and each row's acceptance, queued
  (`launch_round` with the proposals given);
* verify wait: the device finishing that forward;
* settle: reading the round back and accepting each row's drafts on the host;
* rollback: dropping what each row rejected from the batched cache, built, then evaluated.

With `--split`, the propose phase is split at a sync after the drafter's backbone (its layers
over the new context and the block) from its heads (the output head, DSpark's Markov steps,
the draft tokens chosen).

The syncs between phases cost a little each (`trivial eval` below), so the phases add up to
more than a round in the loop, which queues the drafter's work ahead of the verify. Medians
over every round after `--skip` warm-up rounds, in ms.

    python benchmarks/batch_round_phases.py                          # dspark, B = 1 and 8
    python benchmarks/batch_round_phases.py --mode baseline --batches 1,4,8
    python benchmarks/batch_round_phases.py --shape 0.6b --mode oracle    # random weights

`--shape` runs a random-weight Qwen3 of that shape (`loop_efficiency.py`'s) on random prompts,
in mode baseline or oracle (`batch_throughput.py`'s: each row's own greedy continuation, each
token right with probability `--oracle-rate`). `nodes` counts the primitives of each phase's
graph (`mx.export_to_dot`, on the round after the warm-up, which is then left out of the
timings): on a GPU a round's launch costs about the same per node whatever the rows.
"""

from __future__ import annotations

import argparse
import copy
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
from outrider.benchmark.suites import load_suite, parse_suites  # noqa: E402
from outrider.core.batch import Batch  # noqa: E402
from outrider.core.proposer import DraftContext, propose_all  # noqa: E402
from outrider.core.round import _row_inputs, launch_round, settle  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))

PHASES = ("propose", "verify build", "verify wait", "settle", "rollback build", "rollback wait")
SPLIT = ("drafter backbone", "drafter heads")


def prompts_of(pipe, suites: str, n: int) -> list[list[int]]:
    lists = [[p.text for p in load_suite(name)] for name in parse_suites(suites)]
    texts = [t for group in zip(*lists) for t in group]
    return [pipe.encode(texts[i % len(texts)]) for i in range(n)]


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array a batched cache holds, to wait for a rollback's writes."""
    out = []
    for layer in cache:
        for part in getattr(layer, "parts", (layer,)):
            for name in ("keys", "values", "offset", "left_padding", "state"):
                x = getattr(part, name, None)
                if isinstance(x, mx.array):
                    out.append(x)
                elif isinstance(x, list):
                    out += [a for a in x if isinstance(a, mx.array)]
    return out


def nodes(*arrays) -> int:
    """How many primitives the graph behind `arrays` holds (what a launch hands the device)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        return len(re.findall(r"shape=rectangle", path.read_text()))


def forward_nodes(target, rows, proposals, cache: list) -> int:
    """The nodes of a round's verify forward and its argmax (`launch_round` hands them to the
    device before they can be counted), built on a copy of the cache and never evaluated."""
    width = 1 + max(p.k for p in proposals)
    taps = tuple(rows[0].proposer.tap_layer_ids)
    with mx.stream(target.stream):
        inputs = mx.stack(
            [
                _row_inputs(r.anchor, p, p.tokens.astype(mx.uint32), width)
                for r, p in zip(rows, proposals)
            ]
        )
        logits, _ = target.forward_rows(inputs, copy.deepcopy(cache), taps)
        return nodes(mx.argmax(logits, axis=-1))


def split_propose(proposer, sink: dict) -> None:
    """Time a block drafter's backbone apart from its heads: its `_forward` (on this one
    object) evaluates what it returns before handing it on, timed into sink["times"]."""
    inner = proposer._forward

    def forward(*args):
        t = time.perf_counter()
        hidden = inner(*args)
        mx.eval(hidden)
        sink["times"]["drafter backbone"].append((time.perf_counter() - t) * 1e3)
        return hidden

    proposer._forward = forward


def timed_round(
    pipe, batch: Batch, times: dict[str, list[float]], count: dict | None = None
) -> tuple[int, int]:
    """One round of every live row, each phase synced and timed. Returns (rows, tokens).
    With `count`, each graph's nodes go into it (drafter, verify, rollback)."""
    rows = [r for r in batch.rows if not r.done]
    target, cache = pipe.target, batch.cache
    t0 = time.perf_counter()
    ctxs, caps = [], []
    for row in rows:
        cap = max(0, min(row.cap_limit, row.stopper.remaining - 1))
        key = row.keys.next() if row.keys is not None and cap > 0 else None
        ctxs.append(DraftContext(row.history, cap, row.sampling, key, {"room": cap}))
        caps.append(cap)
    with mx.stream(target.stream):
        proposals = propose_all([row.proposer for row in rows], ctxs)
    drafted = [p.tokens for p in proposals if p.k]
    if count is not None and drafted:
        count["drafter"] = nodes(*drafted)
    mx.eval(*drafted)
    if count is not None:  # the verify's forward again, on a copy of the cache, not evaluated
        count["verify"] = forward_nodes(target, rows, proposals, cache)
    t1 = time.perf_counter()
    launched = launch_round(target, rows, cache, caps, given=proposals)
    t2 = time.perf_counter()
    mx.eval(*launched.pending)
    t3 = time.perf_counter()
    steps, rejected = settle(launched)
    t4 = time.perf_counter()
    target.rollback_rows(cache, rejected)
    t5 = time.perf_counter()
    if count is not None:
        count["rollback"] = nodes(*cache_arrays(cache))
    mx.eval(*cache_arrays(cache))
    t6 = time.perf_counter()
    for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
        times[name].append((b - a) * 1e3)
    if times.get("drafter backbone"):
        times["drafter heads"].append(times["propose"][-1] - times["drafter backbone"][-1])
    times["round"].append((t6 - t0) * 1e3)
    return len(rows), sum(len(s.committed) for s in steps)


def profile(pipe, prompts: list[list[int]], max_tokens: int, skip: int, split: bool) -> dict:
    batch = Batch(pipe.target)
    for ids in prompts:
        start = pipe.start_row(ids, max_tokens=max_tokens, stop_tokens=set())
        batch.join(start.row, start.cache)
    names = (*PHASES, "round", *(SPLIT if split else ()))
    times: dict[str, list[float]] = {name: [] for name in names}
    kept, rounds, widths = 0, 0, []
    sink: dict = {}
    count: dict = {}
    for row in batch.rows if split else ():  # rows drafted together run the first one's
        block = getattr(row.proposer, "inner", row.proposer)  # past a lookup assist
        if hasattr(block, "_forward"):
            split_propose(block, sink)
    while batch.rows:
        probe: dict[str, list[float]] = {name: [] for name in times}
        sink["times"] = probe
        counted = rounds == skip  # counting its nodes takes time: this round is not timed
        n, k = timed_round(pipe, batch, probe, count if counted else None)
        batch._keep([r for r in batch.rows if not r.done])
        rounds += 1
        if rounds <= skip or counted or n < len(prompts):  # warm-up, and the batch draining
            continue
        for name, got in probe.items():
            times[name] += got
        kept += k
        widths.append(n)
    out = {name: statistics.median(v) for name, v in times.items() if v}
    out["rounds"] = len(times["round"])
    out["tokens per row-round"] = kept / max(1, sum(widths))
    out["nodes"] = "/".join(str(count.get(k, "-")) for k in ("drafter", "verify", "rollback"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--suite", default="code,math,chat")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip", type=int, default=3, help="warm-up rounds left out")
    ap.add_argument("--split", action="store_true", help="the drafter's backbone apart")
    ap.add_argument("--shape", help="a random-weight qwen3 of this shape (0.6b, 8b) instead")
    ap.add_argument("--dtype", default="bf16", help="with --shape")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --shape")
    ap.add_argument("--oracle-rate", type=float, default=0.8, help="with --shape")
    args = ap.parse_args()

    batches = [int(b) for b in args.batches.split(",")]
    if args.shape:
        from batch_throughput import random_target_pipes

        pipes, random_prompts = random_target_pipes(
            args.shape, args.dtype, [args.mode], max(batches), args.max_tokens,
            args.prompt_len, args.oracle_rate, args.max_draft,
        )  # fmt: skip
        pipe, args.model = pipes[args.mode], f"qwen3-{args.shape}-{args.dtype} (random weights)"
    else:
        pipe = load(args.model, args.drafter, mode=args.mode, max_draft=args.max_draft)

    def prompts(n: int) -> list[list[int]]:
        if args.shape:
            return random_prompts[:n]
        return prompts_of(pipe, args.suite, n)

    t = time.perf_counter()
    for _ in range(3):
        mx.eval(mx.array(1) + 1)
    trivial = (time.perf_counter() - t) / 3 * 1e3
    print(
        f"{args.model} · {args.mode} cap {args.max_draft} · {args.max_tokens} tokens a row · "
        f"{mx.default_device()} · mlx {mx.__version__} · trivial eval {trivial:.3f} ms"
    )
    results = {}
    for b in batches:  # a throwaway run of each width first: kernels built on first use
        profile(pipe, prompts(b), 16, 0, args.split)
    for b in batches:
        results[b] = profile(pipe, prompts(b), args.max_tokens, args.skip, args.split)
    head = f"{'phase (ms, medians)':<22}" + "".join(f"{'B = ' + str(b):>11}" for b in batches)
    print(head)
    print("-" * len(head))
    for name in (*PHASES, "round", *(SPLIT if args.split else ())):
        print(f"{name:<22}" + "".join(f"{results[b].get(name, 0.0):>11.3f}" for b in batches))
    print(f"{'rounds timed':<22}" + "".join(f"{results[b]['rounds']:>11d}" for b in batches))
    print(
        f"{'tokens a row-round':<22}"
        + "".join(f"{results[b]['tokens per row-round']:>11.2f}" for b in batches)
    )
    print(f"{'nodes draft/verify/rb':<22}" + "".join(f"{results[b]['nodes']:>11}" for b in batches))


if __name__ == "__main__":
    main()
