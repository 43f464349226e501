"""Train a DSpark and a DFlash drafter for a toy target on this machine and print what they earn.

    PYTHONPATH=. python examples/train_toy.py [--steps 24] [--out /tmp/outrider-train-toy]

The target is a tiny random qwen3 whose attention and MLP outputs are scaled down, so it is
nearly a bigram model and its greedy answers follow a chain a drafter can learn in a few dozen
steps (the recipe `tests/test_train.py` uses). Prints held-out mean accept length before and
after training, the lossless check against plain decoding, and training tokens/s.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from outrider.testing import make_toy_training_set, toy_train_config
from outrider.train import train_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", default="/tmp/outrider-train-toy")
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    target, prompts = make_toy_training_set(root)
    table = Table("kind", "accept (init)", "accept (trained)", "lossless", "train tok/s", "s")
    for kind in ("dspark", "dflash"):
        report = train_drafter(
            toy_train_config(target, prompts, root / kind, kind=kind, steps=args.steps)
        )
        table.add_row(
            kind,
            f"{report.accept_init:.3f}",
            f"{report.accept_trained:.3f}",
            str(report.lossless),
            f"{report.tokens_per_second:.0f}",
            f"{report.seconds:.1f}",
        )
    Console().print(table)
    print(f"mlx {mx.__version__}, device {mx.default_device()}")


if __name__ == "__main__":
    main()
