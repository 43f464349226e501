"""The `outrider` command line: `generate` and `plugins` here, every other command registered
from the module beside what it runs, and the commands plugins add."""

from __future__ import annotations

import os

# Before anything imports transformers: keep its advisories (e.g. "PyTorch was not found") quiet.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import sys
from typing import TYPE_CHECKING

import typer

from .benchmark.command import benchmark as benchmark_command
from .cli_common import (
    LOOKUP_DRAFTS,
    LOOKUP_LONG_DRAFT,
    TARGET_ALIAS,
    USER_ERRORS,
    cache_root,
    check_context,
    check_options,
    command_plugins,
    one_model,
    parse_max_draft,
    plugins,
    read_prompt,
    user_errors,
)
from .cli_common import console as _console
from .cli_common import debug as _debug
from .cli_common import fail as _fail
from .cli_common import print_json as _print_json
from .cli_common import warn as _warn
from .core import paths
from .core.errors import OutriderError
from .doctor import doctor as _doctor
from .registry.listing import models as _models

BUILTIN_MODES = "auto|dspark|dflash|dflash2|eagle3|draft|lookup|baseline"
Opt = typer.Option

app = typer.Typer(
    name="outrider",
    help="Lossless speculative decoding on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

__all__ = [
    "app",
    "cache_root",
    "check_context",
    "check_options",
    "main",
    "plugins",
    "read_prompt",
    "user_errors",
]

if TYPE_CHECKING:
    from .pipeline import Pipeline


# --- version ---------------------------------------------------------------------------------


def _version() -> str:
    from . import __version__

    return __version__


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"outrider {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = Opt(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Lossless speculative decoding on MLX: DSpark, DFlash and n-gram lookup drafters."""


# --- generate --------------------------------------------------------------------------------


@app.command()
def generate(
    text_argument: str | None = typer.Argument(
        None,
        metavar="[PROMPT]",
        show_default=False,
        help="The prompt (or --prompt); - or none reads standard input.",
    ),
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: demo)."
    ),
    target_alias: str | None = TARGET_ALIAS,
    drafter: str | None = Opt(None, "--drafter", "-d", help="Drafter folder or repo id."),
    draft_model: str | None = Opt(
        None, "--draft-model", help="A small model with the target's tokenizer (mode draft)."
    ),
    num_draft_tokens: int | None = Opt(
        None, "--num-draft-tokens", help="mlx-lm's name for --max-draft (mode draft)."
    ),
    lookup_drafts: bool | None = LOOKUP_DRAFTS,
    lookup_long_draft: int | None = LOOKUP_LONG_DRAFT,
    mode: str = Opt("auto", "--mode", help=f"{BUILTIN_MODES}, or a plugin's strategy."),
    max_draft_text: str | None = Opt(
        None,
        "--max-draft",
        metavar="N|auto",
        help="Draft cap per round; 0 or full = the drafter's full block; auto (the default once "
        "this machine is calibrated: the first run measures it) = measured each round.",
    ),
    confidence_threshold: float | None = Opt(
        None, "--confidence-threshold", help="DSpark: stop drafting below this confidence."
    ),
    drafter_window: int | None = Opt(
        None,
        "--drafter-window",
        metavar="ROWS",
        help="DSpark/DFlash: the drafter sees the latest ROWS context rows (0: all; default 4096).",
    ),
    max_tokens: int = Opt(
        256, "--max-tokens", "-n", "--max-new-tokens", help="Tokens to generate."
    ),
    temperature: float = Opt(0.0, "--temperature", "-t", "--temp", help="0 is greedy."),
    top_p: float = Opt(1.0, "--top-p"),
    top_k: int = Opt(0, "--top-k", help="0 keeps every token."),
    min_p: float | None = Opt(None, "--min-p", hidden=True),  # refused unless 0: not lossless
    seed: int | None = Opt(None, "--seed"),
    prompt: str | None = Opt(
        None, "--prompt", "-p", help="Prompt; - or none reads standard input."
    ),
    system: str | None = Opt(None, "--system", "--system-prompt", help="System message."),
    raw: bool = Opt(
        False,
        "--raw",
        "--ignore-chat-template",  # mlx-lm's spelling
        "--no-chat-template",  # mlx-dspark's
        metavar="",
        help="Feed the prompt as is, no chat template.",
    ),
    no_thinking: bool = Opt(
        False, "--no-thinking", metavar="", help="Turn the model's thinking off."
    ),
    reasoning_budget: int | None = Opt(
        None, "--reasoning-budget", min=0, help="Close the model's thinking after N tokens."
    ),
    budget_message: str | None = Opt(
        None, "--budget-message", help="What closed thinking ends with ('I have to answer now.')."
    ),
    drafter_bits: int = Opt(4, "--drafter-bits", help="Drafter weights: 16, 8 or 4 bits."),
    kv_bits: int | None = Opt(None, "--kv-bits", help="Quantize the KV cache: 8 or 4 bits."),
    stop: list[str] | None = Opt(None, "--stop", help="Stop string (repeatable)."),
    max_kv_size: int | None = Opt(
        None, "--max-kv-size", hidden=True
    ),  # accepted only when the cache never has to rotate
    verbose: str | None = Opt(
        None,
        "--verbose",
        metavar="true|false",
        help="mlx_lm's spelling: false prints only the text; true (the default) adds a summary.",
    ),
    as_json: bool = Opt(False, "--json", metavar="", help="Print one JSON result object only."),
    no_stream: bool = Opt(
        False, "--no-stream", metavar="", help="Print the text once it is all generated."
    ),
) -> None:
    """Generate text with speculative decoding; the output equals the target's own.
    (The default command: `outrider --prompt TEXT` is `outrider generate --prompt TEXT`.)"""
    from .api import load
    from .core.sampling import SamplingParams
    from .demo import demo_target, pair_dir
    from .telemetry import (
        INTERRUPTED,
        generate_until_ctrl_c,
        print_at_once,
        stream_live,
        stream_plain,
    )

    with user_errors():
        model = one_model(model, target_alias)
        max_draft = parse_max_draft(max_draft_text)
        check_options(max_tokens, max_draft, drafter_bits, mode)
        SamplingParams(temperature, top_p, top_k, seed)  # bad sampling fails before loading
        if min_p:  # mlx_lm's --min-p 0 is its default and changes nothing
            raise OutriderError(
                "--min-p is not supported (outrider samples losslessly with --temperature, "
                "--top-p and --top-k)"
            )
        if verbose is not None and verbose.lower() not in ("true", "t", "false", "f"):
            raise OutriderError(f"--verbose takes true or false, got {verbose!r}")
        quiet = verbose is not None and verbose.lower() in ("false", "f")
        if text_argument is not None and prompt is not None:
            raise OutriderError("give the prompt once: as an argument or with --prompt, not both")
        prompt = prompt if text_argument is None else text_argument
        text = read_prompt(None if prompt == "-" else prompt)
        if model is None:
            model = demo_target()
            typer.echo(f"note: no --model given; using the demo pair in {pair_dir()}", err=True)
        # a spinner on a terminal: a first `auto` run or a cold CUDA machine takes minutes
        with _console(stderr=True).status(f"loading {model}"):
            pipe = load(
                model,
                drafter,
                mode,
                max_draft=max_draft,
                drafter_bits=drafter_bits,
                kv_bits=kv_bits,
                confidence_threshold=confidence_threshold,
                plugins=plugins(),
                draft_model=draft_model,
                num_draft_tokens=num_draft_tokens,
                lookup_drafts=lookup_drafts,
                drafter_window=drafter_window,
                lookup_long_draft=lookup_long_draft,
            )
        for note in pipe.notes:
            _warn(note)
        for text in pipe.info:
            typer.echo(f"note: {text}", err=True)
        ids = pipe.encode(text, system=system, raw=raw, thinking=False if no_thinking else None)
        check_context(len(ids), pipe.target.context_window)
        if max_kv_size is not None and max_kv_size < len(ids) + max_tokens:
            raise OutriderError(
                f"--max-kv-size {max_kv_size} would rotate the KV cache and change the output; "
                f"outrider keeps the full cache (this run needs {len(ids) + max_tokens} "
                "positions): drop the flag, or lower --max-tokens"
            )
        kwargs = dict(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop or ()),
        )
        if reasoning_budget is not None:
            if pipe.think_budget(ids, reasoning_budget) is None:
                _warn("--reasoning-budget: this model's thinking has no single-token "
                      "markers to count between; it is not budgeted")  # fmt: skip
            kwargs.update(reasoning_budget=reasoning_budget, budget_message=budget_message)
        _calibrate_first_use(pipe)  # after the checks: bad input is refused at once
        # Ctrl-C stops at the next round and what was made is shown as usual (finish reason
        # "interrupted"), then exit 130; a second Ctrl-C stops at once.
        if as_json:
            result = generate_until_ctrl_c(pipe, ids, kwargs)
            _print_json(result.to_json())
        elif quiet:  # mlx_lm's --verbose false: the text only
            result = stream_plain(pipe, ids, kwargs, summary=False)
        elif no_stream:  # mlx-dspark's: the text at the end, then the summary
            result = generate_until_ctrl_c(pipe, ids, kwargs)
            print_at_once(result)
        elif sys.stdout.isatty():
            result = stream_live(pipe, ids, kwargs, _console())
        else:
            result = stream_plain(pipe, ids, kwargs)
    if result is not None and result.finish_reason == INTERRUPTED:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)


def _calibrate_first_use(pipe: Pipeline) -> None:
    """Measure this machine's costs once where none are kept and no cap was given (a spinner
    while it runs), so `auto` runs from the first generation (`api.calibrate_first_use`)."""
    from .api import calibrate_first_use

    console = _console(stderr=True)
    spinner = console.status("")

    def begin(text: str) -> None:
        if not console.is_terminal:  # a log or a pipe: one line, so a wait is explained
            typer.echo(f"note: {text}", err=True)
            return
        spinner.update(text)
        spinner.start()

    try:
        cal = calibrate_first_use(pipe, status=begin)
    finally:
        spinner.stop()
    if cal is not None:
        typer.echo(f"note: {cal.measured_note()}", err=True)


# --- serve and claude (outrider/server/command.py) ------------------------------------------

from .server.command import register as _register_server  # noqa: E402

_register_server(app)


# --- plugins and models ----------------------------------------------------------------------


@app.command("plugins")
def list_plugins(
    as_json: bool = Opt(False, "--json", metavar="", help="Print JSON."),
) -> None:
    """Every installed plugin and what it provides."""
    from rich.table import Table

    rows = [vars(p) for p in plugins().info()]
    if as_json:
        _print_json(rows)
        return
    if not sys.stdout.isatty():  # pipes and files get whole names, one plugin a line
        for row in rows:
            provides = ", ".join(row["provides"]) or "—"
            typer.echo(f"{row['name']}\t{row['version']}\t{provides}")
        return
    table = Table("plugin", "version", "provides")
    for row in rows:
        table.add_row(row["name"], row["version"], ", ".join(row["provides"]) or "—")
    _console().print(table)


# --- models (outrider/registry/listing.py), doctor (outrider/doctor.py) ---------------------

app.command("models")(_models)
app.command("doctor")(_doctor)


# --- benchmark (outrider/benchmark/) ----------------------------------------------------------

app.command("benchmark")(benchmark_command)

# --- calibrate (outrider/calibrate.py) ------------------------------------------------------

from .calibrate import calibrate as _calibrate  # noqa: E402  (imports typer only)

app.command("calibrate")(_calibrate)

# --- train (outrider/train/command.py) ------------------------------------------------------

from .train.command import train as _train  # noqa: E402  (imports typer only)

app.command("train")(_train)

# --- registry check / add (outrider/registry/command.py) ------------------------------------

from .registry.command import register as _register_registry  # noqa: E402

_register_registry(app)

# --- convert (outrider/convert/command.py) --------------------------------------------------

from .convert.command import convert as _convert  # noqa: E402  (imports typer only)

app.command("convert")(_convert)


# --- entry point -----------------------------------------------------------------------------


def add_plugin_commands(cli: typer.Typer = app) -> None:
    """Let plugins add sub-commands (once per app); a plugin that fails costs a warning line."""
    if getattr(cli, "_outrider_plugin_commands", False):
        return
    cli._outrider_plugin_commands = True
    found = command_plugins()
    if found is None:  # a third-party plugin failed to load: said once already
        return
    try:
        found.register_commands(cli)
    except Exception as e:
        if _debug():
            raise
        _warn(f"a plugin failed to add its commands ({type(e).__name__}: {e})")


# Options of the root command itself: anything else first means `generate` (mlx-dspark's default)
ROOT_OPTIONS = ("--help", "-h", "--version", "--install-completion", "--show-completion")


def default_command(args: list[str]) -> list[str]:
    """`args` with `generate` put first where they begin with one of its options
    (`outrider --prompt TEXT`, as mlx-dspark runs): a command name or a root option first
    leaves them as they are."""
    if args and args[0].startswith("-") and args[0].split("=")[0] not in ROOT_OPTIONS:
        return ["generate", *args]
    return args


def main(argv: list[str] | None = None) -> None:
    """The CLI (`outrider`, `python -m outrider`, through `outrider.__main__.run`)."""
    args = default_command(sys.argv[1:] if argv is None else list(argv))
    if args == ["--version"]:  # no plugin needs loading to say this
        typer.echo(f"outrider {_version()}")
        return
    add_plugin_commands(app)
    paths.keep_kernels()  # MLX's compiled CUDA kernels outlive a reboot (core/paths.py)
    try:
        app(args=args, prog_name="outrider")
    except USER_ERRORS as e:  # raised by plugin commands that did not handle their own
        if _debug():
            raise
        raise SystemExit(_fail(str(e)).exit_code) from None
