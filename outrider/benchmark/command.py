"""The `outrider benchmark` command (registered in outrider/cli.py; helpers from cli_common)."""

from __future__ import annotations

import os
import shlex
import sys

import typer

from ..cli_common import LOOKUP_DRAFTS, LOOKUP_LONG_DRAFT

Opt = typer.Option


def command_line(values: dict) -> str:
    """The full command that reproduces this run, every setting spelled out."""
    words = ["outrider", "benchmark"]
    for flag, value in values.items():
        if value is None or value is False:
            continue
        if isinstance(value, list):
            for item in value:
                words += [flag, str(item)]
            continue
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def benchmark(
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: the demo model)."
    ),
    drafter: str | None = Opt(
        None, "--drafter", "-d", help="A drafter; it serves the mode of its own kind."
    ),
    dspark_drafter: str | None = Opt(None, "--dspark-drafter", help="Drafter for dspark."),
    dflash_drafter: str | None = Opt(None, "--dflash-drafter", help="Drafter for dflash."),
    eagle3_drafter: str | None = Opt(None, "--eagle3-drafter", help="Drafter for eagle3."),
    modes: str | None = Opt(
        None,
        "--modes",
        help="Comma list, e.g. baseline,dspark,dflash,lookup (baseline always runs; default: "
        "baseline, each drafter mode that has a drafter, lookup).",
    ),
    suites: str | None = Opt(
        None,
        "--suites",
        help="Comma list of chat, code, math, copy (default: chat, code, math, or none "
        "when --prompts is given; copy rewrites files with one change).",
    ),
    prompts: list[str] | None = Opt(
        None,
        "--prompts",
        help="Your own prompts: a JSON-lines file with `turns` or `prompt` per row; one more "
        "suite, named after the file (repeatable).",
    ),
    trials: int = Opt(3, "--trials", help="Timed repeats; the table shows medians."),
    max_tokens: int = Opt(128, "--max-tokens", "-n", help="Tokens per prompt (at most)."),
    prompts_per_suite: int | None = Opt(
        None, "--prompts-per-suite", help="Use the first N prompts of each suite (default all)."
    ),
    max_draft_text: str | None = Opt(
        None,
        "--max-draft",
        metavar="N|auto",
        help="Draft cap for every drafting mode and the mlx-lm peer; auto: measured each round "
        "(the default, as for generate: a mode's first run on this machine measures its costs).",
    ),
    caps_text: str | None = Opt(
        None,
        "--caps",
        metavar="N,...,auto",
        help="One arm per cap for each drafting mode (e.g. 2,4,auto), named mode@cap.",
    ),
    peer_draft_model: str | None = Opt(
        None, "--peer-draft-model", help="Also run mlx-lm's speculative decoding with this."
    ),
    draft_model: str | None = Opt(
        None,
        "--draft-model",
        help="Also run mode draft with this small model, and mlx-lm's speculative decoding "
        "with it (unless --peer-draft-model names another), at one cap.",
    ),
    drafter_bits: int = Opt(4, "--drafter-bits", help="Drafter weights: 16, 8 or 4 bits."),
    lookup_drafts: bool | None = LOOKUP_DRAFTS,
    lookup_long_draft: int | None = LOOKUP_LONG_DRAFT,
    drafter_window: int | None = Opt(
        None,
        "--drafter-window",
        metavar="ROWS",
        help="DSpark/DFlash: the drafter sees the latest ROWS context rows (0: all; default 4096).",
    ),
    no_thinking: bool = Opt(False, "--no-thinking", help="Turn the model's thinking off."),
    json_path: str | None = Opt(None, "--json", help="Write the receipt (JSON) to this file."),
    plot_path: str | None = Opt(
        None,
        "--plot",
        help="Write charts to this .png or .svg: speed-up per suite and mode, acceptance per "
        "draft position, tok/s over time (needs `pip install 'outrider\\[plot]'`).",
    ),
    html_path: str | None = Opt(
        None, "--html", help="Write one self-contained HTML report (charts and table) here."
    ),
    from_receipt: str | None = Opt(
        None,
        "--from-receipt",
        help="Run nothing: print the table of this receipt (a --json file) and write its "
        "--plot / --html.",
    ),
) -> None:
    """Measure every mode against plain decoding and mlx-lm on fixed prompt suites.

    Every run's tokens must equal plain decoding's: a divergence that is not a floating-point
    tie stops the benchmark."""
    from .. import cli_common as cli
    from ..core.errors import OutriderError

    with cli.user_errors():
        max_draft = cli.parse_max_draft(max_draft_text)
        caps = [cli.parse_max_draft(c.strip()) for c in (caps_text or "").split(",") if c.strip()]
        if caps_text is not None and not caps:
            raise OutriderError("--caps takes a comma-separated list such as 2,4,auto")
        if plot_path is not None or html_path is not None:
            from .report import plot_format, require_matplotlib

            if plot_path is not None:
                plot_format(plot_path)  # a bad extension fails before anything runs
            require_matplotlib()
        if from_receipt is not None:
            run_flags = {
                "--model": model,
                "--drafter": drafter,
                "--dspark-drafter": dspark_drafter,
                "--dflash-drafter": dflash_drafter,
                "--eagle3-drafter": eagle3_drafter,
                "--modes": modes,
                "--suites": suites,
                "--prompts": prompts,
                "--peer-draft-model": peer_draft_model,
                "--draft-model": draft_model,
                "--json": json_path,
            }
            given = [flag for flag, value in run_flags.items() if value]
            if given:
                raise OutriderError(
                    f"--from-receipt runs nothing, so {', '.join(given)} would do nothing; "
                    "leave it out"
                )
            _render_receipt(from_receipt, plot_path, html_path)
            return
        from ..demo import demo_target
        from .receipt import build_receipt, write_receipt
        from .runner import BenchConfig, LosslessError, run_benchmark
        from .suites import parse_suites, read_user_prompts
        from .table import lossless_line, report_table

        if drafter_bits not in (16, 8, 4):
            raise OutriderError(f"--drafter-bits must be 16, 8 or 4, got {drafter_bits}")
        mode_list = None if modes is None else [m.strip() for m in modes.split(",") if m.strip()]
        if mode_list is not None and not mode_list:
            raise OutriderError("--modes is empty")
        if suites is None:
            suite_list = [] if prompts else parse_suites("chat,code,math")
        else:
            suite_list = parse_suites(suites)
        for path in prompts or ():
            read_user_prompts(path)  # a bad file fails before any model loads
        config = BenchConfig(
            model=model or "",
            modes=mode_list,
            suites=suite_list,
            trials=trials,
            max_tokens=max_tokens,
            prompts_per_suite=prompts_per_suite,
            drafter=drafter,
            drafters={
                m: d
                for m, d in (
                    ("dspark", dspark_drafter),
                    ("dflash", dflash_drafter),
                    ("eagle3", eagle3_drafter),
                )
                if d
            },
            peer_draft_model=peer_draft_model,
            draft_model=draft_model,
            lookup_drafts=lookup_drafts,
            lookup_long_draft=lookup_long_draft,
            drafter_window=drafter_window,
            max_draft=max_draft,
            caps=caps,
            drafter_bits=drafter_bits,
            thinking=False if no_thinking else None,
            prompt_files=list(prompts or ()),
        )
        config.check()
        if model is None:
            config.model = demo_target()
            cli.warn(f"no --model given; benchmarking the demo model at {config.model}")
        line = command_line(
            {
                "--model": config.model,
                "--drafter": drafter,
                "--dspark-drafter": dspark_drafter,
                "--dflash-drafter": dflash_drafter,
                "--eagle3-drafter": eagle3_drafter,
                "--modes": modes,
                "--suites": ",".join(suite_list) or None,
                "--prompts": list(prompts or ()) or None,
                "--trials": trials,
                "--max-tokens": max_tokens,
                "--prompts-per-suite": prompts_per_suite,
                "--max-draft": max_draft,
                "--caps": caps_text,
                "--peer-draft-model": peer_draft_model,
                "--draft-model": draft_model,
                "--drafter-bits": drafter_bits,
                "--no-thinking": no_thinking,
                "--json": json_path,
                "--plot": plot_path,
                "--html": html_path,
            }
        )
        err = cli.console(stderr=True)
        with err.status("loading") as status:

            def progress(arm: str, prompt, trial: int) -> None:
                status.update(f"trial {trial + 1}/{trials} · {prompt.suite} · {arm}")

            try:
                report = run_benchmark(config, cli.plugins(), progress)
            except LosslessError as e:
                raise cli.fail(str(e), code=1) from None
        for arm in report.arms:  # what an arm's load changed or ignored, said once an arm
            for note in arm.get("notes") or ():
                cli.warn(f"{arm['mode']}: {note}")
        wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120
        out = cli.console(width=wide)
        out.print(report_table(report, title=f"outrider benchmark · {config.model}"))
        out.print(lossless_line(report))
        receipt = build_receipt(report, config, line)
        if json_path:
            out.print(f"receipt: {write_receipt(receipt, json_path)}")
        _write_reports(out, receipt, plot_path, html_path)


def _write_reports(out, receipt: dict, plot_path: str | None, html_path: str | None) -> None:
    if plot_path is None and html_path is None:
        return
    from .report import write_html, write_plot

    if plot_path is not None:
        out.print(f"plot: {write_plot(receipt, plot_path)}")
    if html_path is not None:
        out.print(f"html: {write_html(receipt, html_path)}")


def _render_receipt(path: str, plot_path: str | None, html_path: str | None) -> None:
    """`--from-receipt`: the table and charts of a receipt written earlier, nothing run."""
    from .. import cli_common as cli
    from .report import load_receipt
    from .table import receipt_table, summary_line

    receipt = load_receipt(path)
    wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120
    out = cli.console(width=wide)
    model = (receipt.get("model") or {}).get("id") or "?"
    chip = (receipt.get("device") or {}).get("chip")
    title = f"outrider benchmark · {model}" + (f" · {chip}" if chip else "")
    out.print(receipt_table(receipt, title=title))
    if isinstance(receipt.get("lossless"), dict):
        out.print(summary_line(receipt["lossless"]))
    _write_reports(out, receipt, plot_path, html_path)
