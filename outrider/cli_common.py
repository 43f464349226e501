"""What every `outrider` command shares: one-line errors, Ctrl-C handling, the plugin
catalogue, consoles, and the option checks run before any model is loaded.

The command modules (`cli.py`, `benchmark/command.py`, `server/command.py`,
`train/command.py`) import from here and never from each other.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer

from .core.errors import Interrupted, OutriderError
from .core.paths import cache_root  # noqa: F401  (the CLI's commands import it from here)
from .core.plugins import CommandPlugins, Plugins

# OSError: unreadable files, a file where a folder should be, a full disk: one line each.
USER_ERRORS = (OutriderError, ValueError, OSError)
MAX_ERROR = 400


def debug() -> bool:
    """OUTRIDER_DEBUG=1: show tracebacks instead of one-line errors."""
    return os.environ.get("OUTRIDER_DEBUG", "").lower() in ("1", "true", "yes")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print the one-line error the user acts on; callers raise what this returns."""
    line = " ".join(str(message).split()) or "unknown error"
    if len(line) > MAX_ERROR:  # e.g. mlx-lm listing every unexpected weight
        line = line[:MAX_ERROR].rstrip() + " … (OUTRIDER_DEBUG=1 shows all)"
    typer.echo(f"error: {line}", err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn errors a user can act on into one stderr line and exit 2, and Ctrl-C into exit 130
    (tracebacks: OUTRIDER_DEBUG=1)."""
    try:
        yield
    except Interrupted as e:
        if debug():
            raise
        typer.echo(f"\ninterrupted {e}", err=True)
        raise typer.Exit(130) from None
    except USER_ERRORS as e:
        if debug():
            raise
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        # Prefill runs in chunks and decoding in rounds, so Ctrl-C lands within one of them.
        if debug():
            raise
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None


def warn(message: str) -> None:
    typer.echo(f"warning: {' '.join(message.split())}", err=True)


def _plugin_failed(e: Exception) -> None:
    warn(f"a third-party plugin failed to load ({type(e).__name__}: {e}); using built-ins only")


@functools.lru_cache(maxsize=1)
def command_plugins() -> CommandPlugins | None:
    """The plugins that may add commands (`CommandPlugins`: third-party ones alone), asked at
    every start; None where one fails to load, which costs one warning, not the run."""
    try:
        return CommandPlugins()
    except Exception as e:
        if debug():
            raise
        _plugin_failed(e)
        return None


@functools.lru_cache(maxsize=1)
def plugins() -> Plugins:
    """The plugin catalogue; a third-party plugin that fails to load costs a warning, not the
    run (one warning: `command_plugins` has said it where the CLI started)."""
    if command_plugins() is None:
        return Plugins(load_entrypoints=False)
    try:
        return Plugins()
    except Exception as e:
        if debug():
            raise
        _plugin_failed(e)
        return Plugins(load_entrypoints=False)


def console(stderr: bool = False, width: int | None = None):
    """A rich console (imported lazily: `outrider --version` stays fast)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, width=width)


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def read_prompt(prompt: str | None) -> str:
    """--prompt, else standard input when it is piped; never an empty prompt."""
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise OutriderError(
                'no prompt: give one (outrider generate "..."), or pipe text on standard input'
            )
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError as e:
            raise OutriderError(
                f"standard input is not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start})"
            ) from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise OutriderError("the prompt is not valid UTF-8 text") from None
    if not prompt.strip():
        raise OutriderError("the prompt is empty")
    return prompt


# One flag, the same on generate, serve and benchmark (None: the registry row's, else on).
LOOKUP_DRAFTS = typer.Option(
    None,
    "--lookup-drafts/--no-lookup-drafts",
    help="Let drafter rounds verify a lookup copy of the context instead where the text is "
    "being copied (default: the registry row's, else on).",
)

# The longest lookup copy one round verifies (mlx-dspark's flag; on generate, serve, benchmark).
LOOKUP_LONG_DRAFT = typer.Option(
    None,
    "--lookup-long-draft",
    metavar="N",
    help="The longest lookup copy a round verifies: a copy drafts twice its match, up to N "
    "(default 32; 16 in --mode lookup, which reaches it with --max-draft auto or full).",
)

FULL_BLOCK_NOTE = (
    "note: --max-draft 0 (or below) means the drafter's full block, as in mlx-dspark; "
    "--mode baseline decodes without drafts"
)


def parse_max_draft(value: str | None) -> int | str | None:
    """--max-draft: a number of drafts a round, "auto" (measured each round), or "full" (the
    drafter's whole block; mlx-dspark spells it 0 or any number below, said in a note)."""
    if value is None or value in ("auto", "full"):
        return value
    try:
        number = int(value)
    except ValueError:
        raise OutriderError(f"--max-draft takes a number, auto or full, got {value!r}") from None
    if number <= 0:
        typer.echo(FULL_BLOCK_NOTE, err=True)
        return "full"
    return number


def one_model(model: str | None, alias: str | None) -> str | None:
    """--model, or mlx-dspark's older spelling --target (the same flag; both only if equal)."""
    if alias is not None and model is not None and alias != model:
        raise OutriderError("--target is another name for --model: give one of them")
    return model if model is not None else alias


# mlx-dspark's hidden alias of --model, accepted on generate and serve
TARGET_ALIAS = typer.Option(None, "--target", hidden=True)


def check_options(
    max_tokens: int, max_draft: int | str | None, drafter_bits: int, mode: str
) -> None:
    """Reject bad numbers and unknown modes before any model is loaded or built."""
    if max_tokens < 0:
        raise OutriderError(f"--max-tokens must be >= 0, got {max_tokens}")
    if isinstance(max_draft, int) and max_draft < 0:
        raise OutriderError(f"--max-draft must be >= 0, got {max_draft}")
    if drafter_bits not in (16, 8, 4):
        raise OutriderError(f"--drafter-bits must be 16, 8 or 4, got {drafter_bits}")
    if mode != "auto":
        plugins().strategy(mode)


def check_context(n_prompt: int, window: int | None) -> None:
    """The server's rule: a prompt must leave the context window room for one token."""
    if window is not None and n_prompt >= window:
        raise OutriderError(
            f"the prompt is {n_prompt} tokens; this model's context window is {window} "
            "(max_position_embeddings): shorten the prompt"
        )
