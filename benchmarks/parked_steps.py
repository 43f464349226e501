"""What a parked plain step costs against plain decoding's own step, on the same prompts.

`--max-draft auto` parks a drafter that does not pay and decodes plainly (`parked.plain_run`),
but those steps still forward the drafter's tap layers, hand the taps to the drafter, look for
a lookup copy and time themselves for the policy. Plain decoding (`loop._plain_steps`) does none
of that. This runs, per prompt and interleaved (each arm first in turn): plain decoding (mode
baseline), the mode with its policy held parked (every step a parked one), and the same with
lookup copies off (and with `--every-step-taps`, the mode with every parked step tapped, as
before parked runs recomputed their taps where they end: core/parked.py `RETAP_FROM`), and
prints each arm's median time between steps. Then the target's forward
alone, pipelined, without taps and with them dropped, held unevaluated or evaluated with each
step (`--forwards`): what the taps cost the device.

`--host-only` swaps the target's forward for a stand-in that costs next to nothing
(`ReplayedForward`): at each position it gives the token a real run of the prompt gave there,
so every arm decodes the real answer (lookup copies and a host drafter's shadow drafts meet the
real text) and what is left of a step is the loop's own host work. A launch-bound GPU pays that
work in full on every step (a small target's step there is the host's building and launching),
so this is what parking costs such a GPU beyond plain decoding, read on any machine.

    python benchmarks/parked_steps.py --modes dspark,dflash --suite chat --prompts 10
    python benchmarks/parked_steps.py --modes dspark,lookup --suite chat --host-only --forwards 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from outrider.api import Pipeline, load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core import calibration, parked  # noqa: E402
from outrider.core.target import Target  # noqa: E402

DEMO_DRAFTERS = ("dspark", "dflash")  # the demo pair's drafters (outrider-demo/<mode>)


class ReplayedForward:
    """A stand-in for a target's model call (`Target._run`, an instance attribute; the class is
    untouched) that does no model work: the logits at position p pick `text[p + 1]`, the taps
    are zeros of the tapped layers' width, and each cache layer's offset moves as a forward's
    would, so rollbacks and the steps' positions stay right. `play(tokens)` sets the text:
    a prompt and its real answer."""

    def __init__(self, target: Target) -> None:
        self.target, self.text = target, [0]
        self.vocab = int(target.config["vocab_size"])
        self.width = int(target.config["hidden_size"])

    def play(self, tokens: list[int]) -> None:
        self.text = list(tokens)

    def __call__(
        self, ids: mx.array, cache: list, tap_ids: tuple[int, ...], verify: bool = False
    ) -> mx.array:
        n = ids.shape[0]
        start = cache[0].offset
        for layer in cache:
            layer.offset += n
        last = len(self.text) - 1
        picks = mx.array([self.text[min(p + 1, last)] for p in range(start, start + n)])
        logits = (mx.arange(self.vocab)[None] == picks[:, None]).astype(mx.float32)
        sink = self.target._sink
        sink.store = {j: mx.zeros((1, n, self.width)) for j in tap_ids}
        return logits[None]


def hold_parked(pipe: Pipeline) -> None:
    """Make the pipeline's policy park for good (its instance's methods; the class is
    untouched): every step after the first token is a parked plain step."""
    policy = pipe._cap_policy()
    policy.choose = lambda limit: 0
    policy.plain_run = lambda remaining: remaining
    policy.plain_unused = lambda steps: None


def steps_of(pipe: Pipeline, ids: list[int], max_tokens: int, **kw) -> list[float]:
    """Seconds between the yields of one generation (the first token's excluded)."""
    out, last = [], None
    for _chunk in pipe.stream(ids, max_tokens=max_tokens, **kw):
        now = time.perf_counter()
        if last is not None:
            out.append(now - last)
        last = now
    return out


def forwards_alone(pipe: Pipeline, ids: list[int], steps: int, how: str) -> float:
    """Median seconds of a pipelined plain step driving the target's forward directly (no
    loop, no policy, no drafter): `how` is "plain" (no taps), "dropped" (tapped, the taps
    thrown away), "kept" (tapped, the taps held unevaluated, as a parked run hands them to
    the drafter) or "evaluated" (tapped, the taps computed with the step's token)."""
    target = pipe.target
    tap_ids = () if how == "plain" else tuple(pipe.proposer.tap_layer_ids)
    cache = target.make_cache()
    logits, _ = target.forward(mx.array(ids, dtype=mx.uint32), cache)
    y = mx.argmax(logits[-1])
    held: list = []

    def step(y: mx.array) -> tuple[mx.array, mx.array | None]:
        with mx.stream(target.stream):
            logits, taps = target.forward(y.reshape(1).astype(mx.uint32), cache, tap_ids)
            nxt = mx.argmax(logits[-1])
        mx.async_eval(*([nxt, taps] if how == "evaluated" else [nxt]))
        return nxt, taps

    cur, taps = step(y)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        following = step(cur)
        cur.item()
        if how in ("kept", "evaluated"):
            held.append(taps)
        times.append(time.perf_counter() - t)
        cur, taps = following
    cur.item()
    mx.eval(held)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--modes", default="dspark,dflash")
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument(
        "--forwards", type=int, default=128, help="steps of each forward-alone arm (0: none)"
    )
    ap.add_argument(
        "--every-step-taps",
        action="store_true",
        help="an arm of each mode whose parked steps all tap (no recompute where runs end; "
        "the default on the CPU, where the other arms do the same)",
    )
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="the target's forward replaced by a replay of real answers that costs next to "
        "nothing (ReplayedForward): each arm's own host work a step; parked runs stop tapping "
        "after RETAP_FROM steps, as on a CUDA GPU",
    )
    args = ap.parse_args()
    texts = [p.text for p in load_suite(args.suite)][: args.prompts]
    base = load(args.model, None, mode="baseline")
    arms: dict[str, tuple[Pipeline, dict]] = {"baseline": (base, {})}
    for mode in [m for m in args.modes.split(",") if m]:
        demo = args.model == "outrider-demo/target" and mode in DEMO_DRAFTERS
        drafter = f"outrider-demo/{mode}" if demo else None
        for lookup, retap in ((True, True), (False, True), (True, False)):
            if not retap and not args.every_step_taps:
                continue
            if not lookup and mode == "lookup":  # its copies are its drafts
                continue
            pipe = load(args.model, drafter, mode=mode, target=base.target, lookup_drafts=lookup)
            pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)
            if not retap:
                pipe.retap_parked = None
            elif args.host_only:  # as on a CUDA GPU, whatever this machine's default
                pipe.retap_parked = parked.RETAP_FROM
            hold_parked(pipe)
            name = f"{mode} parked" + ("" if lookup else ", no lookup")
            name += "" if retap else ", taps each step"
            arms[name] = (pipe, {"max_draft": "auto"})
    ids = [base.encode(t) for t in texts]
    for pipe, kw in arms.values():  # warm-up: every arm meets every prompt once
        for p in ids:
            pipe.generate(p, max_tokens=args.max_tokens, **kw)
    replay = None
    if args.host_only:
        answers = {tuple(p): base.generate(p, max_tokens=args.max_tokens).tokens for p in ids}
        replay = ReplayedForward(base.target)
        base.target._run = replay  # every arm shares this target
    times: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list[list[int]]] = {name: [] for name in arms}
    names = list(arms)
    for n in range(args.passes):
        for i, p in enumerate(ids):
            turn = (n * len(ids) + i) % len(names)  # each arm goes first in turn
            if replay is not None:
                replay.play(p + answers[tuple(p)])
            for name in names[turn:] + names[:turn]:
                pipe, kw = arms[name]
                times[name] += steps_of(pipe, p, args.max_tokens, **kw)
                tokens[name].append(pipe.generate(p, max_tokens=8, **kw).tokens)
    plain = statistics.median(times["baseline"])
    how = ", host only (the forward replayed)" if replay is not None else ""
    print(f"{args.suite}, {len(ids)} prompts x {args.passes} passes, {args.max_tokens} tokens{how}")
    for name, secs in times.items():
        med = statistics.median(secs)
        same = "" if tokens[name] == tokens["baseline"] else "  OUTPUT DIFFERS"
        print(f"  {name:30s} {len(secs):5d} steps  median {med * 1e3:.3f} ms  "
              f"({med / plain:.3f}x baseline){same}")  # fmt: skip
    if not args.forwards or replay is not None:
        return
    tapped = next(pipe for pipe, _ in arms.values() if pipe.proposer.tap_layer_ids)
    hows = ("plain", "dropped", "kept", "evaluated")
    alone: dict[str, list[float]] = {how: [] for how in hows}
    for n in range(2 * len(hows)):  # each arm first in turn, twice
        for how in hows[n % len(hows) :] + hows[: n % len(hows)]:
            alone[how].append(forwards_alone(tapped, ids[n % len(ids)], args.forwards, how))
    first = statistics.median(alone["plain"])
    print(f"the forward alone, {args.forwards} pipelined steps x {2 * len(hows)}:")
    for how, meds in alone.items():
        med = statistics.median(meds)
        print(f"  taps {how:10s} median {med * 1e3:.3f} ms  ({med / first:.3f}x no taps)")


if __name__ == "__main__":
    main()
