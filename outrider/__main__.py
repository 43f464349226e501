"""The `outrider` command's entry point (and `python -m outrider`).

It imports the CLI inside a Ctrl-C guard: the first seconds of any command are spent importing
MLX, mlx-lm and transformers, and an interrupt there should end the command with one line, not
a traceback from deep inside an import."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from .cli import main

        main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    run()
