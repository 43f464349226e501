"""The benchmark's terminal table: one row per suite and arm, speed-up against baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

if TYPE_CHECKING:  # the runner imports MLX and mlx-lm; a receipt's table needs neither
    from .runner import Report

COLUMNS = (
    ("suite", "left"),
    ("mode", "left"),
    ("cap", "right"),
    ("accept", "right"),
    ("drafted", "right"),  # share of tokens from drafting rounds; the rest were plain steps
    ("decode tok/s", "right"),
    ("speed-up", "right"),
    ("TTFT ms", "right"),
    ("peak GB", "right"),
    ("tokens", "right"),
)


def report_table(report: Report, title: str | None = None) -> Table:
    caps = {a["mode"]: a["cap"] for a in report.arms}
    return results_table([c.to_json() for c in report.cells], caps, title)


def receipt_table(receipt: dict, title: str | None = None) -> Table:
    """The same table from a receipt (what `--json` wrote), as `--from-receipt` prints it."""
    caps = {a["mode"]: a.get("cap") for a in receipt.get("arms") or []}
    caps = caps or dict((receipt.get("settings") or {}).get("caps") or {})
    return results_table(receipt["results"], caps, title)


def results_table(results: list[dict], caps: dict, title: str | None = None) -> Table:
    """One row per receipt `results` entry (suite, mode, accept_len, decode_tps, ...)."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for name, justify in COLUMNS:
        table.add_column(name, justify=justify)
    for i, cell in enumerate(results):
        first = i == 0 or results[i - 1]["suite"] != cell["suite"]
        last = i == len(results) - 1 or results[i + 1]["suite"] != cell["suite"]
        up = cell.get("speedup")
        speedup = "—" if up is None else f"{up:.2f}×"
        if cell["mode"] != "baseline" and up is not None and up >= 1.0:
            speedup = f"[green]{speedup}[/green]"
        share = cell.get("drafted_share")
        table.add_row(
            cell["suite"] if first else "",
            cell["mode"],
            str(caps.get(cell["mode"]) or "—"),
            f"{cell.get('accept_len', 0.0):.2f}",
            "—" if share is None else f"{share:.0%}",
            f"{cell.get('decode_tps', 0.0):.1f}",
            speedup,
            f"{cell.get('ttft_s', 0.0) * 1e3:.1f}",
            f"{cell.get('peak_memory_gb', 0.0):.2f}",
            str(cell.get("tokens", "")),
            end_section=last,
        )
    return table


def lossless_line(report: Report) -> str:
    from .runner import summary

    return summary_line(summary(report))


def summary_line(lossless: dict) -> str:
    """The line under the table, from a receipt's `lossless` object."""
    checked = lossless.get("runs_checked", 0)
    ties = lossless.get("fp_ties") or []
    line = (
        f"lossless: {checked} runs checked against baseline, {checked - len(ties)} token-identical"
    )
    if ties:
        where = ", ".join(f"{d['mode']} {d['prompt']}@{d['position']}" for d in ties)
        line += f", {len(ties)} parted at a floating-point tie ({where})"
    return line
