"""The `outrider calibrate` command: measure what a round costs on this machine for a target and
drafter (the verify curve at every width, at a few context lengths, and the drafter's call),
print it, and keep it where `--max-draft auto` (then the default) and the server find it."""

from __future__ import annotations

import typer

Opt = typer.Option


def calibrate(
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: demo)."
    ),
    drafter: str | None = Opt(None, "--drafter", "-d", help="Drafter folder or repo id."),
    mode: str = Opt("auto", "--mode", help="The mode to calibrate (default: the pair's)."),
    drafter_bits: int = Opt(4, "--drafter-bits", help="Drafter weights: 16, 8 or 4 bits."),
    kv_bits: int | None = Opt(None, "--kv-bits", help="Quantize the KV cache: 8 or 4 bits."),
    contexts: str = Opt("128,1024,4096", "--contexts", help="Context lengths to measure at."),
    max_width: int = Opt(16, "--max-width", help="Widest verify forward to measure."),
    as_json: bool = Opt(False, "--json", metavar="", help="Print JSON."),
) -> None:
    """Measure this machine's costs for a target (and drafter) and keep them."""
    from .api import load
    from .cli_common import console, plugins, print_json, user_errors
    from .core import calibration
    from .core.errors import OutriderError
    from .demo import demo_target

    with user_errors():
        try:
            ctxs = tuple(sorted({int(c) for c in contexts.split(",") if c.strip()}))
        except ValueError:
            raise OutriderError(
                f"--contexts takes integers, like 128,1024; got {contexts!r}"
            ) from None
        if not ctxs or min(ctxs) < 2:
            raise OutriderError("--contexts needs lengths of at least 2 tokens")
        if not 1 <= max_width <= 64:
            raise OutriderError(f"--max-width must be in 1..64, got {max_width}")
        err = console(stderr=True)
        with err.status(f"loading {model or 'the demo pair'}"):
            pipe = load(
                model or demo_target(),
                drafter,
                mode,
                drafter_bits=drafter_bits,
                kv_bits=kv_bits,
                plugins=plugins(),
            )
        need = calibration.needed_width(pipe)
        if max_width < need:
            err.print(
                f"note: --max-width {max_width} is narrower than the {need} rows this pair's "
                f"rounds verify; `--max-draft auto` measures its own curve on first use"
            )
        with err.status("measuring…") as status:

            def progress(done: int, total: int) -> None:
                status.update(f"measuring: pass {done} of {total} over the widths")

            cal = calibration.measure(pipe, ctxs, max_width, progress=progress)
        calibration.save(cal)
        cal.pad(pipe.target)  # what the widths run at with this calibration
    if as_json:
        padding = {str(n): v for n, v in sorted(cal.widths.items())}
        print_json(
            {**cal.as_dict(), "padding": padding, "file": str(cal.path) if cal.path else None}
        )
        return
    _print_table(cal, console())


def _print_table(cal, out) -> None:
    from rich.table import Table

    key = cal.key
    out.print(
        f"{key['target']} · {key['mode']}"
        + (f" · drafter {key['drafter']}" if key["drafter"] else "")
        + f" · {key['device']} {key['device_name']} · mlx {key['mlx']}"
    )
    table = Table("width", *(f"ctx {c} (ms)" for c in sorted(cal.verify_ms)), box=None)
    ctxs = sorted(cal.verify_ms)
    for w in range(len(cal.verify_ms[ctxs[0]])):
        ratio = [cal.verify_ms[c][w] / cal.verify_ms[c][0] for c in ctxs]
        table.add_row(
            str(w + 1), *(f"{cal.verify_ms[c][w]:.3f} ({r:.2f}×)" for c, r in zip(ctxs, ratio))
        )
    out.print(table)
    if cal.plain_ms:  # what auto weighs a drafting round against
        steps = " · ".join(f"ctx {c}: {ms:.3f}" for c, ms in sorted(cal.plain_ms.items()))
        out.print(f"plain step, pipelined (ms): {steps}")
    more = f" + {cal.draft_ms_per_token:.3f} ms a further draft" if cal.draft_ms_per_token else ""
    out.print(f"drafter call: {cal.draft_ms:.3f} ms{more} · attention: {cal.attention}")
    if cal.widths:  # where a wider forward costs less (core/calibration.py)
        shown = ", ".join(f"{n}→{v}" for n, v in sorted(cal.widths.items()))
        out.print(f"verify widths run padded: {shown} (OUTRIDER_MATMUL=native: never)")
    out.print(f"measured in {cal.seconds:.1f} s; kept in {cal.path or '(not writable)'}")
