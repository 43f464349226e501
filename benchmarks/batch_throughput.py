"""Aggregate tokens/s of B requests decoded together (batched rounds) against the same requests
one at a time, per mode. Every batched row is checked against its single-request output.

    python benchmarks/batch_throughput.py                            # the demo pair, B = 8
    python benchmarks/batch_throughput.py --modes baseline,dspark --batch 8 --max-tokens 128
    python benchmarks/batch_throughput.py --shape 0.6b --dtype bf16 --modes baseline,oracle

`--shape` builds a random-weight Qwen3 of that shape in memory (see loop_efficiency.py) and feeds
random prompt ids; its drafting mode is `oracle`, which drafts the known greedy continuation
with each token right with probability `--oracle-rate` (a random-weight drafter accepts
nothing, so it would only measure cost). With a real model the prompts are the first B of
`--suite` (chat templates applied).

Greedy rows of a batch may differ from single requests only at fp ties (batched matmuls round
differently on some backends): each row that differs is checked where it first parts (the two
tokens within a few units in the last place of the top logit, `outrider.benchmark.runner.
check_lossless`), and any other divergence stops the run. The table counts the rows that
differ, the receipt keeps each tie's logits, and `--strict` fails on any.

`--requests N` (N > B) models B clients that each send their next request the moment the
last one ends: N requests, at most B decoding at once, each waiting one joining the round a
row finishes (`Pipeline.generate_batch(max_batch=B)`, the server's continuous batching),
against the same N one at a time. With N = B (the default) all rows start together and the
batch drains to its slowest row.

    python benchmarks/batch_throughput.py --modes baseline,dspark --batch 8 --requests 32 \
        --suite code,math,chat

`--scheduler` picks the batched arm's drafts: `off` (the default) verifies every row's cap, `on`
lets DSpark's prefix scheduler cut them (core/schedule.py `BatchScheduler`), `both` runs the
batched arm both ways and prints the scheduler's throughput over the fixed cap's and the share
of drafts it cut. Each repeat runs both arms, the scheduled one first on every second repeat (a
second arm in one process can read slower for its place alone: use `--repeats 2` or more). The
scheduler reads this machine's verify cost at every width: the stored calibration (`outrider
calibrate`), else one measured now (kept nowhere).

    python benchmarks/batch_throughput.py --modes dspark --batch 8 --scheduler both

`--as-served` runs each arm with MLX's CUDA graphs as `outrider serve` would
(`--cuda-graphs auto`, core/cuda_graphs.py): this process turns them off for the batched arm
(`--max-batch` above 1), and a child process times the one-at-a-time arm again with MLX's
default (on), which a `--max-batch 1` server keeps; the ratio `as served` is the batched time
against the faster of the two one-at-a-time times. Graphs are read once a process, so the
two settings cannot share one. Off a CUDA GPU both processes run alike.

    python benchmarks/batch_throughput.py --modes baseline,dspark --batch 8 --requests 32 \
        --suite code,math,chat --as-served

`--kv-bits 8|4` keeps the target's KV cache quantized in both arms (batched rows in
`QuantizedRows`, plugins/targets/batched.py).

    python benchmarks/batch_throughput.py --modes baseline,dspark --batch 8 --kv-bits 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx

from outrider.benchmark.runner import check_lossless
from outrider.benchmark.suites import load_suite, parse_suites
from outrider.core import calibration, cuda_graphs


def timed(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    mx.synchronize()
    return out, time.perf_counter() - t0


def run_mode(
    pipe, prompts: list[list[int]], width: int, max_tokens: int, repeats: int, arms: list[bool]
) -> dict:
    """One at a time against batched (at most `width` rows at once), the batched arm with the
    scheduler off and/or on (`arms`; the first is reported under the receipts' names, a second
    as `scheduled_*`)."""
    kwargs = dict(max_tokens=max_tokens, stop_tokens=set())

    def one_at_a_time() -> list:
        singles, s = timed(lambda: [pipe.generate(p, **kwargs) for p in prompts])
        seq_times.append(s)
        return singles

    seq_times = []
    if not arms:  # the one-at-a-time arm alone (--as-served's child process)
        warm_up(pipe, prompts, width, kwargs, arms)
        for _ in range(repeats):
            singles = one_at_a_time()
        tokens = sum(len(r.tokens) for r in singles)
        return {
            "mode": pipe.mode,
            "tokens": tokens,
            "sequential_s": sorted(seq_times)[repeats // 2],
        }
    warm_up(pipe, prompts, width, kwargs, arms)
    pipe.scheduler = None  # count what the timed runs cut
    times, outs = {on: [] for on in arms}, {}
    for n in range(repeats):
        singles = one_at_a_time()
        for on in arms if n % 2 == 0 else arms[::-1]:  # with both, each goes first in turn
            pipe.schedule_batches = on
            outs[on], b = timed(lambda: pipe.generate_batch(prompts, max_batch=width, **kwargs))
            times[on].append(b)
    tokens = sum(len(r.tokens) for r in singles)
    seq = sorted(seq_times)[repeats // 2]
    first = arm(pipe, prompts, outs[arms[0]], sorted(times[arms[0]])[repeats // 2], singles)
    sched = pipe.scheduler
    row = {
        "mode": pipe.mode,
        "tokens": tokens,
        "sequential_s": seq,
        "batched_s": first["s"],
        "sequential_tps": tokens / seq,
        "batched_tps": first["tps"],
        "ratio": seq / first["s"],
        "rows_differing": first["rows_differing"],
        "fp_ties": first["fp_ties"],
        "mean_rounds": first["mean_rounds"],
        "mean_accept_len": first["mean_accept_len"],
        "scheduler": "both" if len(arms) == 2 else "on" if arms[0] else "off",
        "drafts_proposed": sched.proposed if sched else 0,  # in the scheduler's rounds
        "drafts_cut": sched.cut if sched else 0,
        "batched_runs_s": times[arms[0]],
    }
    if len(arms) == 2:
        second = arm(pipe, prompts, outs[arms[1]], sorted(times[arms[1]])[repeats // 2], singles)
        row.update({f"scheduled_{k}": v for k, v in second.items()})
        row["scheduled_runs_s"] = times[arms[1]]
        row["scheduler_ratio"] = first["s"] / second["s"]
    return row


def warm_up(pipe, prompts: list[list[int]], width: int, kwargs: dict, arms: list[bool]) -> None:
    """One untimed pass of the whole workload in each arm, as a server that has run a while
    has: every shape the workload meets (each batch width, prompt length and cache size) is
    compiled here, not inside a timed run. A short warm-up left the first batched pass paying
    for the widths it never reached: with `--repeats 1` that was half the random 0.6B
    oracle's batched time on an H100 (docs/server.md, "Warm-up")."""
    for p in prompts:
        pipe.generate(p, **kwargs)
    for on in arms:
        pipe.schedule_batches = on
        pipe.generate_batch(prompts, max_batch=width, **kwargs)


def arm(pipe, prompts: list[list[int]], batched: list, seconds: float, singles: list) -> dict:
    """One batched arm's numbers, its rows checked against the single requests: a row that
    differs must part at an fp tie (else LosslessError)."""
    rounds = [len(r.rounds) or len(r.tokens) for r in batched]
    accept = [r.mean_accept_len for r in batched if r.rounds]
    ties = []
    for i, (one, row) in enumerate(zip(singles, batched, strict=True)):
        where = {"mode": f"{pipe.mode} batched", "suite": "batch", "prompt": i, "trial": 0}
        tie = check_lossless(pipe.target, prompts[i], row.tokens, one.tokens, where)
        if tie is not None:
            ties.append(tie)
    return {
        "s": seconds,
        "tps": sum(len(r.tokens) for r in batched) / seconds,
        "rows_differing": len(ties),
        "fp_ties": ties,
        "mean_rounds": sum(rounds) / len(rounds),
        "mean_accept_len": sum(accept) / len(accept) if accept else None,
    }


def attach_calibration(pipe) -> None:
    """The scheduler's verify costs: the stored calibration, else one measured now (every
    width a batch may reach; not stored, so `--max-draft auto` defaults stay as they were)."""
    if pipe.calibration is None and pipe.proposer.max_draft:
        pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)


def random_target_pipes(
    shape: str,
    dtype: str,
    modes: list[str],
    requests: int,
    max_tokens: int,
    prompt_len: int = 128,
    oracle_rate: float = 0.8,
    cap: int = 4,
    kv_bits: int | None = None,
) -> tuple[dict, list[list[int]]]:
    """A random-weight Qwen3 of `shape` (loop_efficiency.py's) in each of `modes` (baseline,
    oracle) and `requests` random prompts of about `prompt_len` ids; the oracle knows each
    prompt's plain greedy continuation and drafts `cap` tokens, each right at `oracle_rate`.
    Also the other benchmarks' `--shape` (batch_round_phases.py, batch_timeline.py)."""
    from loop_efficiency import make_target

    from outrider.plugins.strategies.baseline import PlainProposer

    target = make_target(shape, dtype)
    if kv_bits:
        target.quantize_kv(kv_bits)  # before the oracle's references are decoded
    rng = random.Random(0)
    vocab = int(target.config["vocab_size"])
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(prompt_len + 7 * (i % 8))]
               for i in range(requests)]  # fmt: skip
    plain = outrider.Pipeline(target, PlainProposer(), "baseline", 0)
    pipes = {}
    for mode in modes:
        if mode == "baseline":
            pipes[mode] = plain
        elif mode == "oracle":
            refs = {tuple(p): p + plain.generate(p, max_tokens=max_tokens + 8,
                                                 stop_tokens=set()).tokens for p in prompts}  # fmt: skip
            pipes[mode] = outrider.Pipeline(
                target, RowOracle(refs, oracle_rate, vocab, cap), "oracle", cap
            )
        else:
            raise SystemExit(f"--shape runs baseline and oracle, not {mode}")
    return pipes, prompts


def suite_texts(suites: str, n: int) -> list[str]:
    """`n` prompts taken from the named suites in turn (cycling when they run out)."""
    lists = [[p.text for p in load_suite(name)] for name in parse_suites(suites)]
    merged = [t for group in zip(*lists) for t in group]  # in turn while every suite has one
    merged += [t for lst in lists for t in lst[len(merged) // len(lists) :]]  # then the rest
    return [merged[i % len(merged)] for i in range(n)]


def accept(value: float | None) -> str:
    return f"{value:.2f}" if value else "—"


class RowOracle:
    """Each row's known greedy continuation, each token right with probability `rate`."""

    name = "oracle"
    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, refs: dict, rate: float, vocab: int, cap: int) -> None:
        self.refs, self.rate, self.vocab, self.max_draft = refs, rate, vocab, cap
        self._inner = None

    def start(self, prompt: list[int], taps) -> None:
        from outrider.testing import OracleProposer

        ref = self.refs[tuple(prompt)]
        self._inner = OracleProposer(ref, self.rate, self.vocab, self.max_draft, len(prompt))

    def propose(self, ctx):
        return self._inner.propose(ctx)

    def propose_ahead(self, ctx):
        return self._inner.propose_ahead(ctx)

    def observe(self, accepted: int, taps) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target (default: the demo pair)")
    ap.add_argument("--drafter")
    ap.add_argument("--modes", default="baseline,dspark")
    ap.add_argument("--shape", help="a random-weight qwen3 of this shape (0.6b, 8b) instead")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", type=int, default=8, help="rows decoding at once (B)")
    ap.add_argument(
        "--requests", type=int, help="requests in all (default: B; more join as rows end)"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="with --shape")
    ap.add_argument("--oracle-rate", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=4, help="with --shape: the oracle's cap")
    ap.add_argument(
        "--suite", default="code", help="one suite, or several (code,math,chat) in turn"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="fail when any row differs")
    ap.add_argument(
        "--scheduler",
        choices=("off", "on", "both"),
        default="off",
        help="the batched arm: every row's cap (off), DSpark's prefix scheduler (on), or both",
    )
    ap.add_argument("--kv-bits", type=int, choices=(8, 4), help="quantize the KV cache")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument(
        "--as-served",
        action="store_true",
        help="each arm with MLX's CUDA graphs as `outrider serve` runs it (see above)",
    )
    ap.add_argument("--singles-only", action="store_true", help=argparse.SUPPRESS)  # its child
    args = ap.parse_args()
    if args.as_served:  # before the first GPU kernel, when MLX reads it
        os.environ[cuda_graphs.ENV] = "0"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.requests = args.requests or args.batch
    if args.requests < args.batch:
        raise SystemExit("--requests must be at least --batch")

    if args.shape:
        pipes, prompts = random_target_pipes(
            args.shape, args.dtype, modes, args.requests, args.max_tokens, args.prompt_len,
            args.oracle_rate, args.cap, args.kv_bits,
        )  # fmt: skip
        name = f"qwen3-{args.shape}-{args.dtype} (random weights)"
    else:
        from outrider.demo import demo_target

        name = args.model or demo_target()
        pipes = {m: outrider.load(name, args.drafter, mode=m, kv_bits=args.kv_bits) for m in modes}
        first = next(iter(pipes.values()))
        prompts = [first.encode(t) for t in suite_texts(args.suite, args.requests)]
    arms = {"off": [False], "on": [True], "both": [False, True]}[args.scheduler]
    if args.singles_only:
        arms = []
    if True in arms:
        for pipe in pipes.values():
            attach_calibration(pipe)
    rows = [
        run_mode(pipes[m], prompts, args.batch, args.max_tokens, args.repeats, arms) for m in modes
    ]
    if args.singles_only:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cuda_graphs": cuda_graphs.state()}, f)
        return
    if args.as_served:
        served = singles_as_served()
        for r in rows:
            other = served[r["mode"]]
            r["sequential_default_graphs_s"] = other
            r["served_ratio"] = min(r["sequential_s"], other) / r["batched_s"]

    print(f"{name} · B = {args.batch} · {len(prompts)} requests · {args.max_tokens} tokens each · {platform.machine()}"
          f" · mlx {mx.__version__} · {mx.default_device()}")  # fmt: skip
    print(f"batched arm: {'fixed cap, then ' if len(arms) == 2 else ''}"
          f"{'prefix scheduler' if arms[-1] else 'fixed cap'}")  # fmt: skip
    head = f"{'mode':<10} {'one at a time':>14} {'batched':>10} {'ratio':>7} {'accept':>7} {'differ':>7}"
    if len(arms) == 2:
        head += f" {'scheduled':>10} {'sched/fixed':>11} {'accept':>7} {'differ':>7} {'cut':>11}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        line = (f"{r['mode']:<10} {r['sequential_tps']:>10.1f} t/s {r['batched_tps']:>6.1f} t/s "
                f"{r['ratio']:>6.2f}x {accept(r['mean_accept_len']):>7} {r['rows_differing']:>7}")  # fmt: skip
        if len(arms) == 2:
            cut = f"{r['drafts_cut']}/{r['drafts_proposed']}"
            line += (f" {r['scheduled_tps']:>6.1f} t/s {r['scheduler_ratio']:>10.2f}x "
                     f"{accept(r['scheduled_mean_accept_len']):>7} "
                     f"{r['scheduled_rows_differing']:>7} {cut:>11}")  # fmt: skip
        elif arms[0]:
            line += f"  (cut {r['drafts_cut']} of {r['drafts_proposed']} drafts)"
        print(line)
    if args.as_served:
        print("\nas served (batched: CUDA graphs off; one at a time: MLX's default, a child "
              "process)")  # fmt: skip
        for r in rows:
            tps = r["tokens"] / r["sequential_default_graphs_s"]
            print(f"{r['mode']:<10} one at a time {tps:>8.1f} t/s with graphs "
                  f"(without: {r['sequential_tps']:.1f}); batched / the faster: "
                  f"{r['served_ratio']:.2f}x")  # fmt: skip
    if args.json:
        meta = {"model": name, "batch": args.batch, "requests": len(prompts),
                "suite": None if args.shape else args.suite, "max_tokens": args.max_tokens,
                "command": " ".join(sys.argv),
                "device": str(mx.default_device()), "mlx": mx.__version__,
                "cuda_graphs": cuda_graphs.state()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    if args.strict and any(r["rows_differing"] or r.get("scheduled_rows_differing") for r in rows):
        raise SystemExit("batched rows differ from single requests")


def singles_as_served() -> dict[str, float]:
    """The one-at-a-time arm again, in a child process that leaves MLX's CUDA graphs at their
    default (as a `--max-batch 1` server does): each mode's median seconds."""
    argv = [a for a in sys.argv[1:] if a != "--as-served"]
    if "--json" in argv:  # the child writes its own
        i = argv.index("--json")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--json=")]
    env = {k: v for k, v in os.environ.items() if k != cuda_graphs.ENV}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "singles.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--singles-only", "--json", out]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            child = json.load(f)
    return {r["mode"]: r["sequential_s"] for r in child["rows"]}


if __name__ == "__main__":
    main()
