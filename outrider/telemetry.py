"""What `outrider generate` shows while it runs: live text, speed, acceptance, and a summary.

Kept apart from the CLI so the rendering can be tested (and reused) without a terminal.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from .core.events import Result

BLOCKS = "▁▂▃▄▅▆▇█"
INTERRUPTED = "interrupted"  # the finish reason of a run Ctrl-C stopped (exit 130)
SHADES = ("red", "dark_orange", "yellow", "chartreuse3", "green")
RIBBON_LEGEND = "one block a round: taller and greener = more of the draft kept; · = no draft"


def accept_block(drafted: int, accepted: int) -> Text:
    """One round as a block: taller and greener the more of its draft the target kept."""
    if drafted <= 0:
        return Text("·", style="dim")
    frac = min(max(accepted / drafted, 0.0), 1.0)
    return Text(
        BLOCKS[round(frac * (len(BLOCKS) - 1))], style=SHADES[round(frac * (len(SHADES) - 1))]
    )


def ribbon(rounds: Sequence[tuple[int, int]], width: int | None = None) -> Text:
    """The acceptance ribbon: one block per (drafted, accepted) round, newest last."""
    shown = rounds[-width:] if width else rounds
    out = Text()
    for drafted, accepted in shown:
        out.append_text(accept_block(drafted, accepted))
    return out


def mean_accept(rounds: Sequence[tuple[int, int]]) -> float:
    """Tokens per target forward, as Result.mean_accept_len counts them."""
    return sum(a + 1 for _, a in rounds) / len(rounds) if rounds else 0.0


def fmt_accept(value: float) -> str:
    return f"{value:.2f}" if value else "—"


def fmt_memory(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1e3:.1f} MB"


class LiveView:
    """The live panel: the tail of the streamed text, a speed line, and the ribbon."""

    def __init__(self, mode: str, cap: int | str) -> None:
        self.mode = mode
        self.cap = cap
        self.text = ""
        self.tokens = 0
        self.rounds: list[tuple[int, int]] = []
        self.decode_start: float | None = None
        self.prefilled: tuple[int, int] | None = None  # (done, total) while a prompt prefills

    def prefill(self, done: int, total: int) -> None:
        """Prefill progress (Pipeline.stream's `prefill_progress`)."""
        self.prefilled = (done, total)

    def add(self, chunk) -> None:
        """Fold one streamed Chunk into the view."""
        self.text += chunk.text
        self.tokens += len(chunk.tokens)
        step = chunk.step
        if step.source == "prefill":
            self.decode_start = time.perf_counter()
        elif step.source == "draft" and (
            chunk.tokens or getattr(step, "finish_reason", None) != "cancelled"
        ):  # a cancelled loop's last step ran no round
            self.rounds.append((len(step.drafted), step.accepted))

    def tokens_per_second(self) -> float:
        if self.decode_start is None:
            return 0.0
        elapsed = time.perf_counter() - self.decode_start
        return max(self.tokens - 1, 0) / elapsed if elapsed > 0 else 0.0

    def status(self) -> Text:
        if self.decode_start is None and self.prefilled is not None:
            done, total = self.prefilled
            return Text.assemble(
                ("prefill ", "bold"),
                f"{done}/{total} prompt tokens ({100 * done // max(total, 1)}%)",
                (" · Ctrl-C stops", "dim"),
            )
        return Text.assemble(
            (f"{self.tokens} tokens", "bold"),
            f" · {self.tokens_per_second():.1f} tok/s",
            f" · accept {fmt_accept(mean_accept(self.rounds))}",
            f" · {len(self.rounds)} rounds",
            (f" · {self.mode} cap {self.cap}", "dim"),
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        room = max(3, (options.height or console.size.height) - 4)
        lines = Text(self.text).wrap(console, width)
        yield from list(lines)[-room:]
        yield Text("─" * min(width, 40), style="dim")
        yield self.status()
        yield ribbon(self.rounds, width)


def summary_table(result: Result) -> Table:
    """The final numbers of a run, one metric a row."""
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("tokens", f"{len(result.tokens)} (prompt {len(result.prompt_tokens)})"),
        ("prefill", f"{result.prefill_tps:.1f} tok/s"),
        ("decode", f"{result.decode_tps:.1f} tok/s"),
        ("mean accept length", fmt_accept(result.mean_accept_len)),
        ("rounds", str(len(result.rounds))),
        ("mode", result.mode),
        ("cap", result.cap_label),
        ("peak memory", fmt_memory(result.peak_memory_gb)),
        ("finish", result.finish_reason),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def final_render(result: Result) -> Group:
    """What stays on screen after the live panel goes: the text, the ribbon and the table."""
    rounds = [(len(r.drafted), r.accepted) for r in result.rounds]
    parts = [Text(result.text), Text("")]
    if rounds:
        parts.append(ribbon(rounds))
        parts.append(Text(RIBBON_LEGEND, style="dim"))
    parts.append(summary_table(result))
    return Group(*parts)


def summary_line(result: Result) -> str:
    """One line for stderr when stdout is not a terminal."""
    return (
        f"{len(result.tokens)} tokens · prefill {result.prefill_tps:.1f} tok/s"
        f" · decode {result.decode_tps:.1f} tok/s · accept {fmt_accept(result.mean_accept_len)}"
        f" · mode {result.mode} · cap {result.cap_label}"
    )


class CtrlC:
    """Ctrl-C as a request to stop, for `with CtrlC() as stop: pipe.stream(..., cancelled=stop)`.

    The first press only sets a flag, which the decoding loop asks between prefill chunks and
    rounds, so generation ends at the next one with what was made kept (finish reason
    "cancelled", which `finish` turns into "interrupted"); no KeyboardInterrupt lands inside an
    MLX call. It also puts the earlier handler back, so a second press interrupts at once. On
    leaving, the earlier handler is back in any case. Off the main thread (where no signal
    handler can be set) or where SIGINT is ignored, it changes nothing and never says stop.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous: object = None
        self._installed = False

    def __call__(self) -> bool:
        return self.pressed

    def _handle(self, signum: int, frame: object) -> None:
        self.pressed = True
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # `nohup`, `cmd &`: Ctrl-C is not ours to take
                # None: a handler set outside Python; Python's own is the nearest equivalent
                self._previous = signal.default_int_handler if previous is None else previous
                signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def finish(self, result: Result | None) -> Result | None:
        """`result`, its finish reason "interrupted" when Ctrl-C is what cut it short."""
        if result is not None and self.pressed and result.finish_reason == "cancelled":
            result.finish_reason = INTERRUPTED
        return result


def generate_until_ctrl_c(pipe, prompt: str | list[int], kwargs: dict) -> Result:
    """`pipe.generate`, with Ctrl-C ending it early with the partial result (`--json`)."""
    with CtrlC() as stop:
        result = pipe.generate(prompt, cancelled=stop, **kwargs)
    return stop.finish(result)


def stream_plain(
    pipe, prompt: str | list[int], kwargs: dict, summary: bool = True
) -> Result | None:
    """Text to stdout as it lands, one summary line to stderr unless `summary` is off (pipes,
    files, CI logs; mlx_lm's `--verbose false`). Ctrl-C ends the text where it got to, and the
    summary is of what was generated (finish reason "interrupted")."""
    result = None
    with CtrlC() as stop:
        for chunk in pipe.stream(prompt, cancelled=stop, **kwargs):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            result = chunk.result or result
    result = stop.finish(result)
    if result is not None:
        sys.stdout.write("" if result.text.endswith("\n") else "\n")
        sys.stdout.flush()
        if summary:
            print(summary_line(result), file=sys.stderr, flush=True)
    return result


def print_at_once(result: Result) -> None:
    """The whole text to stdout, then the summary line to stderr (`--no-stream`)."""
    text = result.text
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
    print(summary_line(result), file=sys.stderr, flush=True)


def stream_live(
    pipe, prompt: str | list[int], kwargs: dict, console: Console | None = None
) -> Result | None:
    """Live telemetry on a terminal; afterwards the full text, the ribbon and a summary table
    (after Ctrl-C too: of what was generated, finish reason "interrupted")."""
    from rich.live import Live

    console = console or Console(highlight=False)
    view = LiveView(pipe.mode, "auto" if pipe.auto_cap else pipe.max_draft)
    result = None
    with CtrlC() as stop, Live(view, console=console, refresh_per_second=12, transient=True):
        for chunk in pipe.stream(prompt, prefill_progress=view.prefill, cancelled=stop, **kwargs):
            view.add(chunk)
            result = chunk.result or result
    result = stop.finish(result)
    if result is not None:
        console.print(final_render(result))
    return result
