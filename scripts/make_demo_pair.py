"""Build outrider's embedded demo pair from scratch, offline, with one command.

    python scripts/make_demo_pair.py --preset demo            # the shipped pair (GPU: ~10 min)
    python scripts/make_demo_pair.py --preset tiny --out DIR  # seconds on a CPU (tests)
    python scripts/make_demo_pair.py --preset demo --target outrider/demo/pair/target
                                                              # new drafters, same target

Stages: (1) corpus: the Python standard library's own .py sources (PSF licence, copied next to
the corpus manifest), plus chat examples made from its functions (user: `def name(`, assistant:
the whole function); (2) a byte-level BPE tokenizer trained with `tokenizers`, with the chat
special tokens and template; (3) a qwen3 model of mlx-lm's own class, trained from scratch with
mlx-lm's trainer; (4) quantised with mlx-lm and saved as a normal mlx-lm folder; (5) DSpark and
DFlash drafters trained by `outrider train` side by side, one process each, on the target's own
answers to function-header prompts (skip with --skip-drafters), and stored 4-bit.
Writes OUT/target, OUT/dspark, OUT/dflash and OUT/recipe.json (sizes, losses, times, hardware).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from demo_pair.drafters import drafter_data, train_drafters  # noqa: E402
from demo_pair.presets import PRESETS, SIZE_LIMIT_MB, Preset, log  # noqa: E402
from demo_pair.summary import folder_mb, hardware, print_summary  # noqa: E402
from demo_pair.target import make_target, reuse_target  # noqa: E402


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--out", type=Path, default=ROOT / "outrider" / "demo" / "pair")
    ap.add_argument("--work", type=Path, help="keep scratch files here (default: a temp dir)")
    ap.add_argument("--steps", type=int, help="target training steps (overrides the preset)")
    ap.add_argument("--drafter-steps", type=int, help="drafter training steps (overrides)")
    ap.add_argument("--minutes", type=float, help="target training time budget (overrides)")
    ap.add_argument("--bits", type=int, choices=(4, 8), help="target quantisation (overrides)")
    ap.add_argument("--prompts", type=int, help="drafters' self-distillation prompts (overrides)")
    ap.add_argument("--skip-drafters", action="store_true", help="stop after the target")
    ap.add_argument(
        "--target", type=Path, help="train drafters for this already-built target (skips 1-4)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    p = PRESETS[args.preset]
    for name in ("steps", "drafter_steps", "minutes", "bits", "prompts"):
        if getattr(args, name) is not None:
            if getattr(args, name) <= 0:
                ap.error(f"--{name.replace('_', '-')} must be > 0")
            p = replace(p, **{name: getattr(args, name)})
    return args, p


def main(argv: list[str] | None = None) -> dict:
    args, p = parse(argv)
    if not args.skip_drafters and importlib_missing("outrider.train"):
        sys.exit(
            "error: `outrider train` is not in this checkout; pass --skip-drafters to build the "
            "target alone"
        )
    with exit_on_signals():
        if args.work is not None:
            return build(args, p, args.work.resolve())
        # the pid names whose scratch it is (tests running recipes side by side check their own)
        with tempfile.TemporaryDirectory(prefix=f"outrider-demo-{os.getpid()}-") as work:
            return build(args, p, Path(work))


@contextlib.contextmanager
def exit_on_signals(signums=(signal.SIGTERM, signal.SIGHUP)):
    """SIGTERM and SIGHUP end the recipe the way Ctrl-C does: as an exception, so that every
    `finally` runs (the drafter workers are stopped, the scratch folder removed) before it exits
    with 128 + the signal's number. A second signal during that cleanup is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for s in signums:
            signal.signal(s, signal.SIG_IGN)
        print(f"[make_demo_pair] {signal.Signals(signum).name}: cleaning up", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build(args: argparse.Namespace, p: Preset, work: Path) -> dict:
    """Every stage, in order; scratch files (float weights, drafter data) go to `work`."""
    t0 = time.perf_counter()
    out: Path = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"preset {args.preset}: {json.dumps(asdict(p))}")
    reuse = args.target.resolve() if args.target is not None else None
    parts = ("dspark", "dflash") if reuse is not None else ("target", "dspark", "dflash")
    for part in parts:
        shutil.rmtree(out / part, ignore_errors=True)
    if reuse is not None:
        summary, pairs = reuse_target(reuse, out, p)
    else:
        summary, pairs = make_target(args, p, out, work)
    times = summary["seconds"]

    drafters: dict[str, dict] = {}
    if not args.skip_drafters:
        data = drafter_data(work, pairs, p, args.seed)
        t = time.perf_counter()
        drafters = train_drafters(out / "target", data, out, p, args.seed)
        times["drafters"] = round(time.perf_counter() - t, 2)
        for kind, d in drafters.items():
            times[f"{kind}_training"] = d.pop("seconds")

    sizes = {part: round(folder_mb(out / part), 2) for part in ("target", "dspark", "dflash")}
    total = round(sum(sizes.values()), 2)
    summary.update(
        {
            "preset": args.preset,
            "settings": asdict(p),
            "drafters": drafters,
            "sizes_mb": sizes,
            "total_mb": total,
            "total_seconds": round(time.perf_counter() - t0, 1),
            "hardware": hardware(),
            "command": " ".join(["python", "scripts/make_demo_pair.py", *args.argv]),
        }
    )
    (out / "recipe.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    if total > SIZE_LIMIT_MB:
        sys.exit(f"error: the pair is {total} MB, over the {SIZE_LIMIT_MB} MB limit")
    return summary


def importlib_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    main()
