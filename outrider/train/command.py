"""The `outrider train` command: flags in, a TrainConfig to `train_drafter`, progress out."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import typer

Opt = typer.Option


def train(
    model: str = Opt(..., "--model", "-m", help="Target folder or repo id."),
    kind: str = Opt("dspark", "--kind", help="dspark, dflash or eagle3."),
    data: list[str] = Opt(
        ..., "--data", help="jsonl ({'turns': [...]} / {'text': ...}), text file or folder."
    ),
    out: str = Opt(..., "--out", "-o", help="Folder for the drafter (DeepSpec packaging)."),
    steps: int = Opt(1000, "--steps", help="Optimizer steps."),
    batch_size: int = Opt(8, "--batch-size", help="Windows per step."),
    seq_len: int = Opt(512, "--seq-len", help="Tokens per training window."),
    lr: float = Opt(6e-4, "--lr", help="Peak learning rate (AdamW)."),
    warmup: int | None = Opt(None, "--warmup", help="Warm-up steps (default: 4% of --steps)."),
    block_size: int = Opt(
        7,
        "--block-size",
        help="Block: anchor + masks (drafts per call); for eagle3 the chain's training depth.",
    ),
    layers: int | None = Opt(None, "--layers", help="Drafter layers (default: from target)."),
    init: str | None = Opt(None, "--init", help="Fine-tune this DeepSpec drafter."),
    max_new_tokens: int = Opt(256, "--max-new-tokens", help="Self-distilled answer length."),
    no_regenerate: bool = Opt(False, "--no-regenerate", help="Use the answers in --data."),
    distill_chunk: int = Opt(
        256,
        "--distill-chunk",
        help="Prompts answered per kept chunk of self-distillation, all at once (raise it on a big GPU).",
    ),
    continue_text: bool = Opt(
        False, "--continue-text", help="Self-distil documents too: the target continues them."
    ),
    no_thinking: bool = Opt(False, "--no-thinking", help="Chat template with thinking off."),
    held_out: int = Opt(8, "--held-out", help="Records kept out for the acceptance report."),
    seed: int = Opt(42, "--seed"),
    resume: bool = Opt(
        False,
        "--resume",
        help="Continue from OUT/checkpoints/: the newest step, or an interrupted "
        "self-distillation (its kept answers are reused; answers made for another model, "
        "--data, --held-out, --seed, --max-new-tokens or --no-thinking are refused).",
    ),
    anchors: int | None = Opt(None, "--anchors", help="Anchors per window (default L/8)."),
    markov_rank: int = Opt(256, "--markov-rank", help="DSpark Markov head rank."),
    markov_type: str = Opt("vanilla", "--markov-type", help="vanilla, gated or rnn."),
    dtype: str = Opt("auto", "--dtype", help="auto, bfloat16 or float32 compute."),
    eval_every: int = Opt(0, "--eval-every", help="Held-out acceptance every N steps."),
    eval_tokens: int = Opt(128, "--eval-tokens", help="Tokens per held-out generation."),
    save_every: int = Opt(0, "--save-every", help="Checkpoint every N steps (0: 10%)."),
    log_every: int = Opt(10, "--log-every", help="Progress line every N steps."),
    no_compile: bool = Opt(False, "--no-compile", help="Skip mx.compile of the step."),
    as_json: bool = Opt(False, "--json", help="Progress and report as JSON lines."),
) -> None:
    """Train a DSpark, DFlash or EAGLE-3 drafter for a target, online.

    The target runs alongside and makes each batch's features as it goes."""
    from ..cli_common import console as _console
    from ..cli_common import user_errors
    from ..core.errors import Interrupted
    from .progress import JsonLines, PlainLines, RichProgress
    from .trainer import TrainConfig, train_drafter

    with user_errors():
        cfg = TrainConfig(
            model=model,
            data=list(data),
            out=out,
            kind=kind,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            warmup=warmup,
            block_size=block_size,
            layers=layers,
            init=init,
            max_new_tokens=max_new_tokens,
            distill_chunk=distill_chunk,
            regenerate=not no_regenerate,
            continue_text=continue_text,
            thinking=False if no_thinking else None,
            held_out=held_out,
            seed=seed,
            resume=resume,
            anchors=anchors,
            markov_rank=markov_rank,
            markov_type=markov_type,
            dtype=dtype,
            eval_every=eval_every,
            eval_tokens=eval_tokens,
            save_every=save_every,
            log_every=log_every,
            compile=not no_compile,
        )
        cfg.check()
        if as_json:
            view = JsonLines()
        elif sys.stdout.isatty():
            view = RichProgress(_console())
        else:
            view = PlainLines()
        try:
            with stop_on_sigterm():
                train_drafter(cfg, on_event=view)
        except (KeyboardInterrupt, Interrupted) as e:  # one line that says what is kept
            raise interrupted(cfg, view, e) from None
        finally:
            view.close()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM stops a run as Ctrl-C does (a checkpoint at the last applied step): what
    `timeout`, `kill`, job schedulers and container runtimes send. A script's background job
    cannot use SIGINT for this, since the shell starts such jobs with SIGINT ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def interrupted(cfg, view, error: BaseException) -> Exception:
    """The Interrupted to report for Ctrl-C (exit 130): where the last checkpoint is, if any.

    The trainer saves one at the last applied step when Ctrl-C lands in a step, and says how
    many self-distilled answers it kept when Ctrl-C lands in the self-distillation (its
    messages say so); elsewhere (loading, the final evaluation, or a second Ctrl-C while it
    saves) what is already on disk is what --resume continues from: the newest checkpoint, else
    the prepared windows, else the self-distilled answers kept so far. The progress view hears
    an "interrupted" event too (a JSON line with --json)."""
    from ..core.errors import Interrupted
    from .data import AnswerStore
    from .run import latest_checkpoint

    root = Path(cfg.out) / "checkpoints"
    latest = latest_checkpoint(root)
    with contextlib.suppress(Exception):  # the view must not hide the interrupt
        view({"event": "interrupted", "checkpoint": None if latest is None else str(latest)})
    if isinstance(error, Interrupted):
        return error
    if latest is not None:
        return Interrupted(f"after the last checkpoint ({latest}); run again with --resume")
    if (root / "windows.safetensors").is_file():
        return Interrupted(
            "before the first checkpoint; the training windows are kept: run again with "
            "--resume to train from step 0 without preparing the data again"
        )
    chunks = AnswerStore.kept_chunks(root / "distill")
    if chunks:
        return Interrupted(
            f"during self-distillation; {chunks} chunks of answers are kept in "
            f"{root / 'distill'}: run again with --resume to continue the self-distillation"
        )
    return Interrupted("before the first checkpoint, nothing kept; run again with --resume")
