"""The benchmark's terminal table: one row per suite and arm, speed-up against baseline."""

from __future__ import annotations

from rich import box
from rich.table import Table

from .runner import Report

COLUMNS = (
    ("suite", "left"),
    ("mode", "left"),
    ("cap", "right"),
    ("accept", "right"),
    ("decode tok/s", "right"),
    ("speed-up", "right"),
    ("TTFT ms", "right"),
    ("peak GB", "right"),
    ("tokens", "right"),
)


def report_table(report: Report, title: str | None = None) -> Table:
    caps = {a["mode"]: a["cap"] for a in report.arms}
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for name, justify in COLUMNS:
        table.add_column(name, justify=justify)
    cells = report.cells
    for i, cell in enumerate(cells):
        first = i == 0 or cells[i - 1].suite != cell.suite
        last = i == len(cells) - 1 or cells[i + 1].suite != cell.suite
        speedup = "—" if cell.speedup is None else f"{cell.speedup:.2f}×"
        if cell.arm != "baseline" and cell.speedup is not None and cell.speedup >= 1.0:
            speedup = f"[green]{speedup}[/green]"
        table.add_row(
            cell.suite if first else "",
            cell.arm,
            str(caps.get(cell.arm) or "—"),
            f"{cell.accept_len:.2f}",
            f"{cell.decode_tps:.1f}",
            speedup,
            f"{cell.ttft_s * 1e3:.1f}",
            f"{cell.peak_memory_gb:.2f}",
            str(cell.tokens),
            end_section=last,
        )
    return table


def lossless_line(report: Report) -> str:
    ties = len(report.divergences)
    line = (
        f"lossless: {report.checked} runs checked against baseline, "
        f"{report.checked - ties} token-identical"
    )
    if ties:
        where = ", ".join(f"{d['mode']} {d['prompt']}@{d['position']}" for d in report.divergences)
        line += f", {ties} parted at a floating-point tie ({where})"
    return line
