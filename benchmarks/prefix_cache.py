"""Time to first token with the prefix cache off and on: turn N of a chat, and an exact repeat.

A conversation of random token ids (any model): a system prompt of `--system-tokens`, then
turns of `--user-tokens` user ids each followed by the model's own greedy answer of
`--answer-tokens`. TTFT is wall time from `Pipeline.stream` to the first chunk (prefix lookup,
restore and suffix prefill included). With the cache on, turns 1..N-1 run first, so turn N
reuses the whole conversation so far; the repeat then sends turn N's prompt again. Outputs are
checked equal to the cache-off run's, or parted only at an fp tie (checked; else the run fails).

    python benchmarks/prefix_cache.py                       # a tiny random qwen3, on any machine
    python benchmarks/prefix_cache.py --model mlx-community/Qwen3-4B-4bit --system-tokens 4096
    python benchmarks/prefix_cache.py --shape 8b --dtype bf16  # random weights, Qwen3-8B's shape

`--cold` measures what a real conversation meets on a GPU whose kernels depend on the shapes
(MLX's CUDA attention builds a cuDNN graph per query and key length): each repeat is a new
conversation whose system prompt is a little longer than the last one's, so no shape was seen
before. Its turns 1..N run with the cache on (turn 1 a miss), turn N's prompt is sent again
(the exact repeat), then it is prefilled with the cache off twice: the first time cold, as a
fresh request meets it, the second time warm. One run gives both of issue 12's ratios.

The H200 targets of issue 12: TTFT ratio >= 20x at turn 5 with a 4k-token system prompt, and
>= 50x on an exact repeat.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import outrider
from outrider.core.prefix_cache import PrefixCache


def ttft(pipe, ids: list[int], max_tokens: int, mode_cap: int | None) -> tuple[float, list[int]]:
    """(seconds to the first chunk, the greedy answer)."""
    t0 = time.perf_counter()
    first = None
    result = None
    for chunk in pipe.stream(ids, max_tokens=max_tokens, stop_tokens=set(), max_draft=mode_cap):
        if first is None:
            first = time.perf_counter() - t0
        if chunk.result is not None:
            result = chunk.result
    return first, result.tokens


def tie_or_fail(target, prompt: list[int], got: list[int], want: list[int]) -> dict:
    """Where a cache-on answer parts from the cache-off one, the two tokens must be tied at
    the top of the target's logits (within a few bf16 ulps): prefilling a suffix splits the
    prompt into other chunks than one full prefill, which on a GPU rounds differently. Any
    other divergence is a bug and ends the run."""
    import mlx.core as mx

    i = next(j for j, (x, y) in enumerate(zip(got, want)) if x != y)
    logits, _ = target.forward(mx.array(prompt + want[:i], dtype=mx.uint32), target.make_cache())
    row = logits[-1].astype(mx.float32)
    a, b, top = row[want[i]].item(), row[got[i]].item(), mx.max(row).item()
    tol = 0.05 * max(abs(top), 1e-6)
    print(f"  divergence at answer token {i}: logit {a:.4f} vs {b:.4f} (max {top:.4f})")
    if abs(a - b) > tol or min(a, b) < top - tol:
        raise SystemExit(f"LOSSLESS CHECK FAILED: the cached answer diverges at token {i}")
    return {"position": i, "logits": [a, b], "max": top}


def conversation(
    vocab: int, args: argparse.Namespace, seed: int = 0, longer: int = 0
) -> tuple[list, list]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    return ids(args.system_tokens + longer), [ids(args.user_tokens) for _ in range(args.turns)]


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def play(pipe, system: list[int], users: list[list[int]], args) -> tuple[list, list, list]:
    """Each turn's prompt (the conversation so far, the model's own answers in it), its time
    to first token and its answer, with whatever prefix cache `pipe` has."""
    prompts, times, answers, history = [], [], [], list(system)
    for user in users:
        history += user
        prompts.append(list(history))
        s, answer = ttft(pipe, prompts[-1], args.answer_tokens, args.max_draft)
        times.append(s)
        answers.append(answer)
        history += answer
    return prompts, times, answers


def report(rows: list, title: str, identical: bool, ties: list, json_path, fields: dict) -> None:
    """The table of (scenario, TTFT off, TTFT on) rows, and the same as JSON when asked."""
    width = max(14, *(len(name) for name, _, _ in rows))
    print(title)
    print(f"{'scenario':<{width}} {'TTFT off (ms)':>14} {'TTFT on (ms)':>13} {'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<{width}} {a * 1e3:>14.2f} {b * 1e3:>13.2f} {a / b:>7.1f}x")
    print("outputs identical with the cache on:", identical,
          f"(fp ties: {len(ties)})" if ties else "")  # fmt: skip
    if json_path:
        out = {**fields, "identical": identical, "fp_ties": ties,
               "rows": [{"scenario": n, "ttft_off_s": a, "ttft_on_s": b} for n, a, b in rows]}  # fmt: skip
        Path(json_path).write_text(json.dumps(out, indent=2))


def cold_runs(pipe, vocab: int, args: argparse.Namespace) -> dict:
    """`--cold`: per repeat a new conversation at new lengths, its turns with the cache on and
    its last prompt again (the exact repeat), then that prompt with the cache off, cold and
    warm. Medians over the repeats."""
    turns, repeats, off_cold, off_warm, ties, same = [], [], [], [], [], True
    for r in range(args.repeats):
        system, users = conversation(vocab, args, seed=r + 1, longer=17 * (r + 1))
        pipe.prefix_cache = PrefixCache.from_gb(args.gb)
        prompts, times, answers = play(pipe, system, users, args)
        prompt, answer = prompts[-1], answers[-1]
        again_s, again = ttft(pipe, prompt, args.answer_tokens, args.max_draft)
        pipe.prefix_cache = None
        cold, off_answer = ttft(pipe, prompt, args.answer_tokens, args.max_draft)
        warm, _ = ttft(pipe, prompt, args.answer_tokens, args.max_draft)
        for got in (answer, again):
            if got != off_answer:
                ties.append(tie_or_fail(pipe.target, prompt, got, off_answer))
        same &= answer == off_answer == again
        turns.append(times)
        repeats.append(again_s)
        off_cold.append(cold)
        off_warm.append(warm)
        print(f"  repeat {r}: {len(prompt)} prompt tokens, turns (ms) "
              + " ".join(f"{t * 1e3:.1f}" for t in times)
              + f" | repeat {again_s * 1e3:.1f}"
              + f" | cache off cold {cold * 1e3:.1f}, warm {warm * 1e3:.1f}")  # fmt: skip
    return {"turns": turns, "repeats": repeats, "off_cold": off_cold, "off_warm": off_warm, "identical": same,
            "fp_ties": ties}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target folder or repo id (default: a tiny random qwen3)")
    ap.add_argument(
        "--shape", help="a random-weight qwen3 of this shape instead (0.6b, 8b, 32b; in memory)"
    )
    ap.add_argument("--dtype", default="bf16", help="with --shape: bf16, 4bit or fp32")
    ap.add_argument("--drafter")
    ap.add_argument("--mode", default="baseline")
    ap.add_argument("--max-draft", type=int)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median)")
    ap.add_argument("--cold", action="store_true", help="new shapes every repeat (see above)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()

    model = args.model
    if args.shape:  # the random-weight shapes of loop_efficiency.py, built in memory
        from loop_efficiency import make_target

        from outrider.plugins.strategies.baseline import PlainProposer

        target = make_target(args.shape, args.dtype)
        model = target.name
        pipe = outrider.Pipeline(target, PlainProposer(), "baseline", 0)
    else:
        if model is None:
            from outrider.testing import make_tiny_target

            model = str(make_tiny_target(Path(tempfile.mkdtemp()) / "qwen3", family="qwen3"))
        pipe = outrider.load(model, args.drafter, mode=args.mode)
    vocab = int(pipe.target.config.get("vocab_size") or 32000)
    if args.cold:
        ttft(pipe, list(range(10, 10 + args.user_tokens)), 2, args.max_draft)  # load-time work
        got = cold_runs(pipe, vocab, args)
        last = median([t[-1] for t in got["turns"]])
        identical, ties = got.pop("identical"), got.pop("fp_ties")
        rows = [
            (f"turn {args.turns} cold", median(got["off_cold"]), last),
            (f"turn {args.turns} vs warm off", median(got["off_warm"]), last),
            ("exact repeat", median(got["off_cold"]), median(got["repeats"])),
            ("exact repeat vs warm off", median(got["off_warm"]), median(got["repeats"])),
        ]
        title = f"model {model}  mode {pipe.mode}  --cold, {args.repeats} conversations"
        fields = {"model": model, "mode": pipe.mode, "cold": True, **got}
        report(rows, title, identical, ties, args.json, fields)
        return
    system, users = conversation(vocab, args)

    prompts, _, _ = play(pipe, system, users, args)  # the model's own answers, cache off
    last = prompts[-1]

    off, off_answer = [], None
    for _ in range(args.repeats):
        s, off_answer = ttft(pipe, last, args.answer_tokens, args.max_draft)
        off.append(s)

    turn_on, repeat_on, same, ties = [], [], True, []
    for _ in range(args.repeats):
        pipe.prefix_cache = PrefixCache.from_gb(args.gb)
        for p in prompts[:-1]:
            ttft(pipe, p, args.answer_tokens, args.max_draft)
        s, answer = ttft(pipe, last, args.answer_tokens, args.max_draft)
        turn_on.append(s)
        r, again = ttft(pipe, last, args.answer_tokens, args.max_draft)
        repeat_on.append(r)
        for got in (answer, again):
            if got != off_answer:
                ties.append(tie_or_fail(pipe.target, last, got, off_answer))
        same &= answer == off_answer == again
    pipe.prefix_cache = None

    rows = [
        (f"turn {args.turns}", median(off), median(turn_on)),
        ("exact repeat", median(off), median(repeat_on)),
    ]
    title = f"model {model}  mode {pipe.mode}  prompt {len(last)} tokens"
    fields = {"model": model, "mode": pipe.mode, "prompt_tokens": len(last)}
    report(rows, title, same, ties, args.json, fields)


if __name__ == "__main__":
    main()
