"""Where a prefix-cache hit's time to first token goes: lookup (with the restore of the cached
layers), the suffix's prefill, and the rest, against the bare forwards they are made of.

    python benchmarks/ttft_phases.py                       # tiny random qwen3, any machine
    python benchmarks/ttft_phases.py --shape 32b --dtype bf16 --system-tokens 4096

Plays a conversation as benchmarks/prefix_cache.py does (turns of user ids and the model's
own greedy answers), then times turn N's prompt once more with each phase synchronised: the
lookup (restore evaluated), the target's prefill of what the hit leaves, and the whole call
to the first chunk. The floors are bare forwards on a restored cache: the suffix in one
forward, and one token. Synchronising each phase adds a sync or two; the whole call is timed
without the wrappers too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

from prefix_cache import conversation, median, play, ttft  # noqa: E402

import outrider  # noqa: E402
from outrider.core.prefix_cache import PrefixCache  # noqa: E402
from outrider.core.target import Target  # noqa: E402


def timed(owner, name: str, log: dict, sync) -> None:
    """Wrap owner.name so each call is synchronised and its seconds logged under `name`."""
    inner = getattr(owner, name)

    def wrapper(*a, **kw):
        mx.synchronize()
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        sync(out)
        log.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    setattr(owner, name, wrapper)
    return inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-draft", type=int)
    ap.add_argument("--gb", type=float, default=8.0)
    args = ap.parse_args()
    if args.shape:
        from loop_efficiency import make_target

        from outrider.plugins.strategies.baseline import PlainProposer

        target = make_target(args.shape, args.dtype)
        pipe = outrider.Pipeline(target, PlainProposer(), "baseline", 0)
    else:
        import tempfile

        from outrider.testing import make_tiny_target

        path = make_tiny_target(Path(tempfile.mkdtemp()) / "qwen3", family="qwen3")
        pipe = outrider.load(str(path), None, mode="baseline")
    vocab = int(pipe.target.config.get("vocab_size") or 32000)
    ttft(pipe, list(range(10, 10 + args.user_tokens)), 2, args.max_draft)
    system, users = conversation(vocab, args)
    prompts, answers = [], []

    def earlier_turns() -> None:
        """A fresh prefix cache holding turns 1..N-1, as turn N finds it."""
        pipe.prefix_cache = PrefixCache.from_gb(args.gb)
        got, _, said = play(pipe, system, users[:-1], args)
        if not prompts:
            prompts.extend(got)
            answers.extend(said)

    earlier_turns()
    last = prompts[-1] + answers[-1] + users[-1]
    hit_len = pipe.prefix_cache.lookup(pipe.target, last).length
    print(f"turn {args.turns}: {len(last)} prompt tokens, {hit_len} cached, "
          f"{len(last) - hit_len} to prefill")  # fmt: skip

    plain = []
    for _ in range(args.repeats):  # the plain call, as prefix_cache.py times it
        earlier_turns()
        plain.append(ttft(pipe, last, 1, args.max_draft)[0])

    log: dict = {}
    sync_hit = lambda h: mx.eval([c.state for c in h.cache]) if h is not None else None  # noqa: E731
    sync_out = lambda out: mx.eval(out)  # noqa: E731
    lookup = timed(PrefixCache, "lookup", log, sync_hit)
    prefill = timed(Target, "prefill", log, sync_out)
    whole = []
    try:
        for _ in range(args.repeats):
            PrefixCache.lookup, Target.prefill = lookup, prefill
            earlier_turns()
            timed(PrefixCache, "lookup", log, sync_hit)
            timed(Target, "prefill", log, sync_out)
            whole.append(ttft(pipe, last, 1, args.max_draft)[0])
    finally:
        PrefixCache.lookup, Target.prefill = lookup, prefill

    target = pipe.target
    suffix = mx.array(last[hit_len:], dtype=mx.uint32)
    floors: dict = {}
    for name, ids in (("forward suffix", suffix), ("forward 1 token", suffix[-1:])):
        for _ in range(args.repeats):
            hit = pipe.prefix_cache.lookup(target, last)
            sync_hit(hit)
            mx.synchronize()
            t0 = time.perf_counter()
            with mx.stream(target.stream):
                logits, _ = target.forward(ids, hit.cache, ())
            mx.eval(logits)
            floors.setdefault(name, []).append(time.perf_counter() - t0)
    ms = lambda xs: f"{median(xs) * 1e3:9.2f} ms"  # noqa: E731
    print(f"  TTFT (plain call)          {ms(plain)}")
    print(f"  TTFT (phases synchronised) {ms(whole)}")
    for name in ("lookup", "prefill"):
        print(f"    {name:<22} {ms(log[name])}")
    for name, xs in floors.items():
        print(f"  floor: {name:<18} {ms(xs)}")


if __name__ == "__main__":
    main()
