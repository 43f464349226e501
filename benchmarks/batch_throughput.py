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
differently on some backends); the table counts rows that differ, and `--strict` fails on any.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import mlx.core as mx

import outrider
from outrider.benchmark.suites import load_suite


def timed(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    mx.synchronize()
    return out, time.perf_counter() - t0


def run_mode(pipe, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    kwargs = dict(max_tokens=max_tokens, stop_tokens=set())
    pipe.generate_batch(prompts[:2], max_tokens=8, stop_tokens=set())  # warm-up (compiles)
    seq_times, batch_times = [], []
    for _ in range(repeats):
        singles, s = timed(lambda: [pipe.generate(p, **kwargs) for p in prompts])
        seq_times.append(s)
        batched, b = timed(lambda: pipe.generate_batch(prompts, **kwargs))
        batch_times.append(b)
    tokens = sum(len(r.tokens) for r in singles)
    differ = sum(a.tokens != b.tokens for a, b in zip(singles, batched))
    seq, bat = sorted(seq_times)[repeats // 2], sorted(batch_times)[repeats // 2]
    rounds = [len(r.rounds) or len(r.tokens) for r in batched]
    accept = [r.mean_accept_len for r in batched if r.rounds]
    return {
        "mode": pipe.mode,
        "tokens": tokens,
        "sequential_s": seq,
        "batched_s": bat,
        "sequential_tps": tokens / seq,
        "batched_tps": sum(len(r.tokens) for r in batched) / bat,
        "ratio": seq / bat,
        "rows_differing": differ,
        "mean_rounds": sum(rounds) / len(rounds),
        "mean_accept_len": sum(accept) / len(accept) if accept else None,
    }


def random_target_pipes(args, modes: list[str]) -> tuple[dict, list[list[int]]]:
    from loop_efficiency import make_target

    from outrider.plugins.strategies.baseline import PlainProposer

    target = make_target(args.shape, args.dtype)
    rng = random.Random(0)
    vocab = int(target.config["vocab_size"])
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]]
    prompts += [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len + 7 * i)]
                for i in range(1, args.batch)]  # fmt: skip
    plain = outrider.Pipeline(target, PlainProposer(), "baseline", 0)
    pipes = {}
    for mode in modes:
        if mode == "baseline":
            pipes[mode] = plain
        elif mode == "oracle":
            refs = {tuple(p): p + plain.generate(p, max_tokens=args.max_tokens + 8,
                                                 stop_tokens=set()).tokens for p in prompts}  # fmt: skip
            pipes[mode] = outrider.Pipeline(
                target, RowOracle(refs, args.oracle_rate, vocab, args.cap), "oracle", args.cap
            )
        else:
            raise SystemExit(f"--shape runs baseline and oracle, not {mode}")
    return pipes, prompts


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

    def observe(self, accepted: int, taps) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target (default: the demo pair)")
    ap.add_argument("--drafter")
    ap.add_argument("--modes", default="baseline,dspark")
    ap.add_argument("--shape", help="a random-weight qwen3 of this shape (0.6b, 8b) instead")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="with --shape")
    ap.add_argument("--oracle-rate", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=4, help="with --shape: the oracle's cap")
    ap.add_argument("--suite", default="code")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="fail when any row differs")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    if args.shape:
        pipes, prompts = random_target_pipes(args, modes)
        name = f"qwen3-{args.shape}-{args.dtype} (random weights)"
    else:
        from outrider.demo import demo_target

        name = args.model or demo_target()
        pipes = {m: outrider.load(name, args.drafter, mode=m) for m in modes}
        first = next(iter(pipes.values()))
        texts = [p.text for p in load_suite(args.suite, args.batch)]
        prompts = [first.encode(t) for t in texts]
    rows = [run_mode(pipes[m], prompts, args.max_tokens, args.repeats) for m in modes]

    print(f"{name} · B = {len(prompts)} · {args.max_tokens} tokens each · {platform.machine()}"
          f" · mlx {mx.__version__} · {mx.default_device()}")  # fmt: skip
    head = f"{'mode':<10} {'one at a time':>14} {'batched':>10} {'ratio':>7} {'accept':>7} {'differ':>7}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        acc = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "—"
        print(f"{r['mode']:<10} {r['sequential_tps']:>10.1f} t/s {r['batched_tps']:>6.1f} t/s "
              f"{r['ratio']:>6.2f}x {acc:>7} {r['rows_differing']:>7}")  # fmt: skip
    if args.json:
        meta = {"model": name, "batch": len(prompts), "max_tokens": args.max_tokens,
                "device": str(mx.default_device()), "mlx": mx.__version__}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    if args.strict and any(r["rows_differing"] for r in rows):
        raise SystemExit("batched rows differ from single requests")


if __name__ == "__main__":
    main()
