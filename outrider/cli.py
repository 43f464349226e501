"""The `outrider` command line: generate, benchmark, plugins, models, doctor, and plugin commands."""

from __future__ import annotations

import os

# Before anything imports transformers: keep its advisories (e.g. "PyTorch was not found") quiet.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import platform
import sys
from pathlib import Path
from typing import Any

import typer

from .benchmark.command import benchmark as benchmark_command
from .cli_common import (
    USER_ERRORS,
    cache_root,
    check_context,
    check_options,
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
from .core.device import split_attention
from .core.errors import OutriderError
from .core.plugins import Plugins

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
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: demo)."
    ),
    drafter: str | None = Opt(None, "--drafter", "-d", help="Drafter folder or repo id."),
    draft_model: str | None = Opt(
        None, "--draft-model", help="A small model with the target's tokenizer (mode draft)."
    ),
    num_draft_tokens: int | None = Opt(
        None, "--num-draft-tokens", help="mlx-lm's name for --max-draft (mode draft)."
    ),
    no_lookup_drafts: bool = Opt(
        False,
        "--no-lookup-drafts",
        metavar="",
        help="Drafter rounds never verify a lookup copy of the context instead.",
    ),
    mode: str = Opt("auto", "--mode", help=f"{BUILTIN_MODES}, or a plugin's strategy."),
    max_draft_text: str | None = Opt(
        None,
        "--max-draft",
        metavar="N|auto",
        help="Draft cap per round; 0 = the drafter's full block; auto = measured each round.",
    ),
    confidence_threshold: float | None = Opt(
        None, "--confidence-threshold", help="DSpark: stop drafting below this confidence."
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
        "--ignore-chat-template",
        metavar="",
        help="Feed the prompt as is, no chat template.",
    ),
    no_thinking: bool = Opt(
        False, "--no-thinking", metavar="", help="Turn the model's thinking off."
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
) -> None:
    """Generate text with speculative decoding; the output equals the target's own."""
    from .api import load
    from .core.sampling import SamplingParams
    from .demo import demo_target, pair_dir
    from .telemetry import INTERRUPTED, generate_until_ctrl_c, stream_live, stream_plain

    with user_errors():
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
                lookup_drafts=False if no_lookup_drafts else None,
            )
        for note in pipe.notes:
            _warn(note)
        if max_draft == 0:  # mlx-dspark's spelling of the full block; baseline is --mode baseline
            pipe.max_draft = pipe.proposer.max_draft
            typer.echo(
                f"note: --max-draft 0 now means the drafter's full block (cap {pipe.max_draft}), "
                "as in mlx-dspark; --mode baseline decodes without drafts",
                err=True,
            )
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
        # Ctrl-C stops at the next round and what was made is shown as usual (finish reason
        # "interrupted"), then exit 130; a second Ctrl-C stops at once.
        if as_json:
            result = generate_until_ctrl_c(pipe, ids, kwargs)
            _print_json(result.to_json())
        elif quiet:  # mlx_lm's --verbose false: the text only
            result = stream_plain(pipe, ids, kwargs, summary=False)
        elif sys.stdout.isatty():
            result = stream_live(pipe, ids, kwargs, _console())
        else:
            result = stream_plain(pipe, ids, kwargs)
    if result is not None and result.finish_reason == INTERRUPTED:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)


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


def _size_gb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def model_rows(online: bool = False) -> list[dict]:
    """The registry rows, with what is already downloaded marked, sizes (from local files;
    with `online`, the Hub's safetensors headers for the rest) and whether each pair fits this
    machine (weights + KV cache at the context window + the row's drafter; an estimate)."""
    from dataclasses import asdict

    from .core import fit
    from .core.hub import local_model
    from .registry import load_pairs

    memory = fit.machine_memory()
    found: dict[str, Path | None] = {}

    def locate(repo: str) -> Path | None:  # each repo looked up once
        if repo not in found:
            found[repo] = local_model(repo)
        return found[repo]

    rows = []
    for pair in load_pairs():
        row = asdict(pair)
        row["target_local"] = locate(pair.target) is not None
        drafter = pair.drafters.get(pair.mode)
        try:
            est = fit.estimate(pair.target, drafter, online=online, memory=memory, locate=locate)
        except Exception:  # a broken cache entry must not break the list
            est = fit.Estimate(memory=memory[0], memory_source=memory[1])
        recorded = row.get("size_gb")  # a registry row may record its target's size
        if est.weights is None and isinstance(recorded, (int, float)) and recorded > 0:
            est.weights = int(recorded * 1e9)
        row["drafters"] = {}
        for m, r in pair.drafters.items():
            size = est.drafter if r == drafter else _model_size(r, online, locate)
            local = locate(r) is not None
            row["drafters"][m] = {"repo": r, "local": local, "size_gb": _size_gb(size)}
        row["cached"] = row["target_local"]
        row["size_gb"] = _size_gb(est.weights)
        row["fits"] = est.fits
        row["estimate"] = {
            "weights_bytes": est.weights,
            "kv_cache_bytes": est.kv_cache,
            "context_window": est.window,
            "drafter": drafter,
            "drafter_bytes": est.drafter,
            "total_bytes": est.total,
        }
        rows.append(row)
    return rows


def _model_size(repo: str, online: bool, locate: Any) -> int | None:
    from .core import fit

    try:
        return fit.model_bytes(repo, online, locate)[0]
    except Exception:
        return None


def _repo_lines(row: dict) -> list[tuple[str, str, str, str]]:
    """(cached, role, repo, size) for a row's target and each of its drafters."""
    lines = [("target", row["target"], row["target_local"], row["size_gb"])]
    lines += [(m, d["repo"], d["local"], d.get("size_gb")) for m, d in row["drafters"].items()]
    return [
        ("[green]yes[/green]" if local else "[dim]no[/dim]", role, repo, _shown_gb(size))
        for role, repo, local, size in lines
    ]


def _shown_gb(size: float | None) -> str:
    if size is None:
        return "?"
    return f"{size:.1f} GB" if size >= 1 else f"{size * 1000:.1f} MB"


def _shown_fits(fits: bool | None) -> str:
    return {True: "[green]yes[/green]", False: "[red]no[/red]", None: "?"}[fits]


def _default_cap(plug: Plugins, mode: str) -> str:
    """The cap a row without one runs at: its strategy's default ("—" when none applies)."""
    strategy = plug.strategies.get(mode)
    cap = getattr(strategy, "default_cap", None)
    return str(cap) if cap else "—"


@app.command()
def models(
    as_json: bool = Opt(False, "--json", metavar="", help="Print JSON."),
    online: bool = Opt(
        False,
        "--online",
        metavar="",
        help="Read sizes of models not downloaded from the Hub's safetensors headers.",
    ),
) -> None:
    """Known target/drafter pairs: cached, size, and whether each fits this machine."""
    from rich import box
    from rich.table import Table

    from .core import fit

    rows, plug = model_rows(online), plugins()
    installed = {"families": sorted(plug.families), "strategies": sorted(plug.strategies)}
    memory, source = fit.machine_memory()
    if online and fit.hub_unreachable():
        _warn("the Hugging Face Hub could not be reached: sizes of models not downloaded are ?")
    if as_json:
        _print_json({"pairs": rows, **installed, "memory": {"bytes": memory, "source": source}})
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    widths = {"id": 18, "family": 12, "speedup": 14, "source": 9, "repo": 56}
    names = ("id", "family", "mode", "cap", "speedup", "source", "fits", "cached", "role")
    for name in (*names, "repo", "size"):
        table.add_column(name, overflow="fold", max_width=widths.get(name), min_width=len(name))
    for r in rows:
        for i, (cached, role, repo, size) in enumerate(_repo_lines(r)):
            first = (
                r["id"],
                r["family"],
                r["mode"],
                str(r["cap"] or _default_cap(plug, r["mode"])),
                r["speedup"] or "—",
                r["source"].split(":", 1)[0] or "—",
                _shown_fits(r["fits"]),
            )
            table.add_row(
                *(first if i == 0 else [""] * len(first)),
                cached,
                role,
                repo,
                size,
                end_section=i == len(r["drafters"]),
            )
    wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
    console = _console(width=wide)
    console.print(table)
    console.print(
        "cached = in the Hugging Face cache or LM Studio already; size = weights (local files"
        + ("; the Hub's headers for the rest)" if online else "; --online asks the Hub)")
    )
    console.print(
        "fits = weights + KV cache at the context window + the row's drafter, against "
        f"{fit.gb(memory)} ({source or 'unknown'}): an estimate; --json has the figures"
    )
    console.print(f"target families: {', '.join(installed['families']) or 'none'}")
    console.print(f"strategies: {', '.join(installed['strategies']) or 'none'}")


# --- doctor ----------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _backend(mx: Any, name: str) -> bool | None:
    """Whether mx.<name> says it is available (None: this MLX build has no such backend)."""
    backend = getattr(mx, name, None)
    try:
        return bool(backend.is_available()) if backend is not None else None
    except Exception:
        return False


def _mlx_report(problems: list[str]) -> dict:
    import mlx.core as mx

    try:
        if (mx.arange(4) * 2).sum().item() != 12:
            problems.append("MLX computed 2*(0+1+2+3) wrongly")
    except Exception as e:
        problems.append(f"MLX failed a tiny computation: {type(e).__name__}: {e}")
    return {
        "mlx_version": getattr(mx, "__version__", None),
        "mlx_default_device": str(mx.default_device()),
        "metal_available": _backend(mx, "metal"),
        "cuda_available": _backend(mx, "cuda"),
    }


def _place(path: Path) -> dict:
    return {"path": str(path), "exists": path.is_dir()}


def doctor_report() -> dict:
    """Everything worth knowing when something does not work, with the problems spelled out."""
    from huggingface_hub import constants

    from .core import calibration
    from .core.hub import lmstudio_roots

    problems: list[str] = []
    report: dict[str, Any] = {
        "outrider_version": _version(),
        "python_version": platform.python_version(),
        "python": sys.executable,
        "platform": platform.platform(),
        **_mlx_report(problems),
        "mlx_lm_version": _dist_version("mlx-lm"),
    }
    if report["mlx_lm_version"] is None:
        problems.append("mlx-lm is not installed")
    plug = plugins()
    report["plugins"] = [vars(p) for p in plug.info()]
    report["target_families"] = sorted(plug.families)
    if not plug.families:
        problems.append("no plugin provides a target family: no model can be loaded")
    if not plug.strategies:
        problems.append("no plugin provides a drafting strategy")
    try:
        report["attention"] = "split" if split_attention() else "native"
    except OutriderError as e:
        report["attention"] = None
        problems.append(str(e))
    report["cpu_blas"] = _blas_report()
    report["hf_cache"] = _place(Path(constants.HF_HUB_CACHE))
    report["lmstudio_dirs"] = [_place(p) for p in lmstudio_roots()]
    report["outrider_cache"] = _place(cache_root())
    report["calibrations"] = [
        {**c.key, "created": c.created, "file": str(c.path)} for c in calibration.stored()
    ]
    report["problems"] = problems
    return report


def _blas_report() -> str:
    """The BLAS MLX's CPU backend multiplies floats with (core/blas.py)."""
    from .core import blas

    state = blas.state()
    if state.optimized:
        return state.path
    hint = ""
    if state.note == blas.NOT_FOUND:
        hint = " (Debian/Ubuntu: apt install libopenblas0)"
    return f"MLX's own: {state.note}{hint}"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['path']} ({'exists' if value['exists'] else 'absent'})"
    return {True: "yes", False: "no", None: "n/a"}.get(value, str(value))


@app.command()
def doctor(as_json: bool = Opt(False, "--json", help="Print JSON.")) -> None:
    """Check the installation: versions, backends, plugins, caches, problems."""
    from rich.table import Table

    report = doctor_report()
    if as_json:
        _print_json(report)
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    for key, value in report.items():
        if key == "plugins":
            value = ", ".join(p["name"].rsplit(".", 1)[-1] for p in value)
        if key == "target_families":
            value = ", ".join(value)
        if key == "calibrations":
            value = f"{len(value)} kept (outrider calibrate; --json lists them)"
        if key not in ("problems", "lmstudio_dirs"):
            table.add_row(key.replace("_", " "), _shown(value))
    for place in report["lmstudio_dirs"]:
        table.add_row("lm studio dir", _shown(place))
    console = _console()
    console.print(table)
    for problem in report["problems"]:
        console.print(f"[red]problem:[/red] {problem}")
    if not report["problems"]:
        console.print("[green]no problems found[/green]")


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
    try:
        plugins().register_commands(cli)
    except Exception as e:
        if _debug():
            raise
        _warn(f"a plugin failed to add its commands ({type(e).__name__}: {e})")


def main(argv: list[str] | None = None) -> None:
    """The CLI (`outrider`, `python -m outrider`, through `outrider.__main__.run`)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:  # no plugin needs loading to say this
        typer.echo(f"outrider {_version()}")
        return
    add_plugin_commands(app)
    try:
        app(args=argv, prog_name="outrider")
    except USER_ERRORS as e:  # raised by plugin commands that did not handle their own
        if _debug():
            raise
        raise SystemExit(_fail(str(e)).exit_code) from None
