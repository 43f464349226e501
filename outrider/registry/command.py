"""`outrider registry check` and `outrider registry add RECEIPT.json` (registered in cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean
from typing import Any

import typer

from ..cli_common import fail, plugins, user_errors
from .resolver import DRAFTER_MODES, normalise, receipts_dir, registry_text
from .validate import read_receipt, receipt_problems, registry_problems

Opt = typer.Option
Arg = typer.Argument

app = typer.Typer(
    name="registry",
    help="Validate the registry of target/drafter pairs, or draft a row from a receipt.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command("check")
def check(
    file: Path | None = Opt(
        None,
        "--file",
        "-f",
        help="A registry TOML (default: the shipped one); its receipts are read from receipts/ "
        "beside it.",
    ),
) -> None:
    """Validate the registry rows and every receipt they cite; exit 1 naming each problem."""
    with user_errors():
        if file is not None:
            text, folder, shown = file.read_text(), file.parent / "receipts", str(file)
        else:
            text, folder, shown = registry_text(), receipts_dir(), "registry"
        problems, rows = registry_problems(text, plugins(), folder)
    if problems:
        for line in problems:
            typer.echo(f"problem: {line}", err=True)
        typer.echo(f"{shown}: {len(problems)} problem(s) in {rows} rows", err=True)
        raise typer.Exit(1)
    receipts = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    typer.echo(f"{shown}: {rows} rows and {receipts} receipts valid")


def _speedups(receipt: dict, mode: str) -> list[tuple[str, float]]:
    cells = [r for r in receipt["results"] if r["mode"] == mode and r.get("speedup") is not None]
    return sorted(((r["suite"], float(r["speedup"])) for r in cells), key=lambda c: -c[1])


def best_mode(receipt: dict) -> str | None:
    """The outrider arm (not baseline) with the highest mean speed-up over the suites."""
    arms = [
        a["mode"]
        for a in receipt["arms"]
        if a.get("kind") == "outrider" and a["mode"] != "baseline" and _speedups(receipt, a["mode"])
    ]
    return max(arms, key=lambda m: mean(s for _, s in _speedups(receipt, m)), default=None)


def drafter_architecture(drafter: str) -> str:
    """The `architectures` value of a drafter's config.json, when its files are at hand."""
    from ..core.checkpoint import read_config
    from ..core.errors import OutriderError
    from ..core.hub import resolve_model

    try:
        archs = read_config(resolve_model(drafter, "drafter", download=False)).get("architectures")
    except (OutriderError, OSError, ValueError):
        return ""
    return str(archs[0]) if isinstance(archs, list) and archs else ""


def _toml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value).lower()


def row_for(receipt: dict, receipt_name: str, mode: str | None = None) -> str:
    """The `[[pair]]` row a contributor adds for this receipt (they check id and family)."""
    mode = mode or best_mode(receipt) or "lookup"
    arm = next((a for a in receipt["arms"] if a["mode"] == mode), None)
    if arm is None:
        raise ValueError(
            f"{receipt_name} has no {mode} arm (arms: "
            f"{', '.join(a['mode'] for a in receipt['arms'])})"
        )
    model = receipt["model"]
    chip = receipt["device"]["chip"]
    cells = _speedups(receipt, mode)
    speedup = ", ".join(f"{s:.2f}x {suite}" for suite, s in cells) + f" ({mode}, {chip})"
    lines = [
        f"# from {receipt_name}: check id and family, add aliases if the target goes by other",
        "# names, and copy the receipt to outrider/registry/receipts/ (docs/registry.md)",
        "[[pair]]",
        f"id = {_toml(normalise(model['id']))}",
        f"target = {_toml(model['id'])}",
        f"family = {_toml(model.get('family') or 'dense')}",
        f"mode = {_toml(mode)}",
    ]
    if mode in DRAFTER_MODES and arm.get("drafter"):
        arch = drafter_architecture(arm["drafter"])
        note = "" if arch else "  # architecture: the drafter config.json's `architectures` value"
        lines.append(
            f"{mode} = {{ repo = {_toml(arm['drafter'])}, architecture = {_toml(arch)} }}{note}"
        )
    lines += [
        f"cap = {arm['cap']}",
        "confidence_threshold = 0.0",
        f"speedup = {_toml(speedup)}",
        f"receipt = {_toml(receipt_name)}",
        f"source = {_toml('receipt: ' + receipt_name)}",
    ]
    return "\n".join(lines) + "\n"


@app.command("add")
def add(
    receipt_file: Path = Arg(
        ..., metavar="RECEIPT.json", help="A receipt from `benchmark --json`."
    ),
    mode: str | None = Opt(None, "--mode", help="The row's mode (default: the fastest arm)."),
) -> None:
    """Print the targets.toml row for a receipt; copy the receipt to outrider/registry/receipts/."""
    with user_errors():
        receipt, bad = read_receipt(receipt_file)
        bad = bad or receipt_problems(receipt, receipt_file.name)
        if bad:
            raise fail("; ".join(bad), code=1)
        typer.echo(row_for(receipt, receipt_file.name, mode), nl=False)


def register(cli: typer.Typer) -> None:
    cli.add_typer(app, name="registry")
