"""`outrider models`: the registry's target/drafter pairs, what of them is downloaded, their
sizes, and whether each pair fits this machine."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from ..cli_common import console as _console
from ..cli_common import plugins
from ..cli_common import print_json as _print_json
from ..cli_common import warn as _warn
from ..core.plugins import Plugins

Opt = typer.Option


def _size_gb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def model_rows(online: bool = False) -> list[dict]:
    """The registry rows, with what is already downloaded marked, sizes (from local files;
    with `online`, the Hub's safetensors headers for the rest) and whether each pair fits this
    machine (weights + KV cache at the context window + the row's drafter; an estimate)."""
    from dataclasses import asdict

    from ..core import fit
    from ..core.hub import local_model
    from . import load_pairs

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
    from ..core import fit

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

    from ..core import fit

    rows, plug = model_rows(online), plugins()
    installed = {"families": sorted(plug.families), "strategies": sorted(plug.strategies)}
    memory, source = fit.machine_memory()
    if online and fit.hub_unreachable():
        _warn("the Hugging Face Hub could not be reached: sizes of models not downloaded are ?")
    if as_json:
        _print_json({"pairs": rows, **installed, "memory": {"bytes": memory, "source": source}})
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
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
