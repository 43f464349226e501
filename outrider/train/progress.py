"""Showing a training run: a rich progress bar on a terminal, plain lines in logs, or JSON lines.

Each view is a callable taking the trainer's events (dicts with an "event" key).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

Event = dict[str, Any]


class JsonLines:
    """One JSON object per event on stdout (`--json`): logs a machine can read."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def __call__(self, event: Event) -> None:
        self.stream.write(json.dumps(event) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def describe(event: Event) -> str | None:
    """One human-readable line per event (None for events not worth a line)."""
    kind = event["event"]
    if kind == "regenerate":
        return f"self-distillation: the target answered {event['done']}/{event['total']} prompts"
    if kind == "data":
        if event.get("reused"):
            return f"data: {event['windows']} windows (reused from the checkpoint folder)"
        return f"data: {event['windows']} windows, {event['tokens']} supervised tokens"
    if kind == "resume":
        return f"resuming at step {event['step']} from {event['checkpoint']}"
    if kind == "start":
        return f"training {event['steps']} steps from step {event['from_step']}"
    if kind == "step":
        extra = "".join(f" {k} {event[k]:.4f}" for k in ("ce", "l1", "confidence") if k in event)
        return (
            f"step {event['step']}/{event['steps']} loss {event['loss']:.4f}{extra} "
            f"tau~{event['tau']:.3f} lr {event['lr']:.2e} {event['tokens_per_s']:.0f} tok/s"
        )
    if kind == "eval":
        return (
            f"held-out acceptance ({event['which']}, step {event['step']}): "
            f"{event['mean_accept_len']:.3f} tokens/forward over {event.get('rounds', 0)} rounds"
        )
    if kind == "checkpoint":
        return None
    if kind == "done":
        return (
            f"done: {event['out']} — accept {event['init']['mean_accept_len']:.3f} → "
            f"{event['trained']['mean_accept_len']:.3f}, lossless {event['lossless']}, "
            f"{event['tokens_per_second']:.0f} tok/s"
        )
    return None


class PlainLines:
    """Readable progress lines for logs and pipes (stdout not a terminal)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def __call__(self, event: Event) -> None:
        line = describe(event)
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        pass


class RichProgress:
    """A live bar (step, loss, tokens/s, latest held-out acceptance) with events printed above."""

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.progress = Progress(
            TextColumn("[bold]train[/bold]"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("accept {task.fields[accept]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = None
        self.accept = "—"

    def __call__(self, event: Event) -> None:
        kind = event["event"]
        if kind == "start":
            self.progress.start()
            self.task = self.progress.add_task(
                "train",
                total=event["steps"],
                completed=event["from_step"],
                loss="—",
                tps="—",
                accept=self.accept,
            )
        if kind == "eval":
            self.accept = f"{event['mean_accept_len']:.3f}"
        if self.task is not None and kind in ("step", "eval"):
            fields: dict[str, Any] = {"accept": self.accept}
            if kind == "step":
                fields.update(
                    completed=event["step"],
                    loss=f"{event['loss']:.4f}",
                    tps=f"{event['tokens_per_s']:.0f}",
                )
            self.progress.update(self.task, **fields)
        line = describe(event)
        if line and kind != "step":
            self.console.print(line, markup=False, highlight=False)
        if kind == "done":
            self.close()

    def close(self) -> None:
        self.progress.stop()
