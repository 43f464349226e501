"""Stage 5: DSpark and DFlash drafters, trained by `outrider train` on the target's own answers."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

from .presets import Preset, log
from .summary import folder_mb


def drafter_data(work: Path, pairs, p: Preset, seed: int) -> list[Path]:
    """Prompts the target answers itself: the drafters learn the target's own greedy text
    (self-distillation), which is what they must predict at generation time."""
    rng = random.Random(seed)
    chosen = rng.sample(pairs, min(p.prompts, len(pairs)))
    prompts = work / "drafter-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [head]}) + "\n" for head, _ in chosen))
    return [prompts]


def train_drafter(kind: str, target: Path, data: list[Path], out: Path, p: Preset, seed: int):
    """`outrider train` in this process, with its plain progress lines (same flags as the CLI:
    `--steps --batch-size --seq-len --lr --warmup --block-size --layers --max-new-tokens
    --held-out --seed`)."""
    from outrider.train import TrainConfig, train_drafter
    from outrider.train.progress import PlainLines

    cfg = TrainConfig(
        model=str(target),
        data=[str(f) for f in data],
        out=str(out),
        kind=kind,
        steps=p.drafter_steps,
        batch_size=p.drafter_batch,
        seq_len=p.drafter_seq_len,
        lr=p.drafter_lr,
        warmup=p.drafter_warmup,
        block_size=p.block_size,
        layers=p.drafter_layers,
        max_new_tokens=p.max_new_tokens,
        held_out=p.held_out,
        seed=seed,
    )  # thinking left default: the prompt form `generate` uses
    log(f"outrider train --kind {kind}: {p.drafter_steps} steps")
    view = PlainLines()
    try:
        report = train_drafter(cfg, on_event=view)
    finally:
        view.close()
    return report.to_json()


def train_drafters(target: Path, data: list[Path], out: Path, p: Preset, seed: int) -> dict:
    """DSpark and DFlash side by side, one process each: a small drafter's training is bound
    by the host's kernel launches, so two runs share one GPU (or CPU) well.

    The workers never outlive this call: on any way out (a worker's failure, an exception or
    KeyboardInterrupt here, SIGTERM turned into SystemExit by the recipe) the ones still running
    are terminated, then killed if they linger, and joined. Each worker also exits by itself if
    this process dies without that chance (SIGKILL)."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")  # a fresh MLX per child, no forked device state
    workers: dict[str, tuple] = {}
    try:
        for kind in ("dspark", "dflash"):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(send, kind, target, data, out / kind, p, seed),
                name=f"outrider-demo-{kind}",
            )
            proc.start()
            send.close()  # the child holds the only sending end: EOF if it dies
            workers[kind] = (proc, receive)
        results: dict[str, dict] = {}
        pending = {receive: kind for kind, (_, receive) in workers.items()}
        while pending:
            for receive in wait(list(pending)):
                kind = pending.pop(receive)
                try:
                    status, value = receive.recv()
                except EOFError:
                    proc = workers[kind][0]
                    proc.join()
                    raise RuntimeError(
                        f"{kind} drafter worker died (exit code {proc.exitcode})"
                    ) from None
                if status != "ok":
                    raise RuntimeError(f"{kind} drafter training failed:\n{value}")
                results[kind] = value
        return {kind: results[kind] for kind in workers}
    finally:
        stop_workers([proc for proc, _ in workers.values()])
        for _, receive in workers.values():
            receive.close()


def stop_workers(procs, grace: float = 10.0) -> None:
    """Terminate whatever is still running, kill what ignores that, and reap every one."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _worker(send, kind: str, target: Path, data: list[Path], out: Path, p: Preset, seed: int):
    """A drafter process: the result (or the traceback) goes back through `send`."""
    import traceback

    _exit_with_parent()
    try:
        result = ("ok", drafter_job(kind, target, data, out, p, seed))
    except BaseException:  # KeyboardInterrupt and SystemExit too: the parent must hear of it
        result = ("error", traceback.format_exc())
    send.send(result)
    send.close()


def _exit_with_parent() -> None:
    """End this worker at once if the recipe's process goes away without stopping it."""
    import multiprocessing
    import os
    import threading
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def drafter_job(kind: str, target: Path, data: list[Path], out: Path, p: Preset, seed: int):
    from outrider.core.quantized import quantize_checkpoint

    t = time.perf_counter()
    report = train_drafter(kind, target, data, out, p, seed)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    quantize_checkpoint(out, bits=4)
    seconds = round(time.perf_counter() - t, 2)
    mb = round(folder_mb(out), 2)
    log(f"{kind}: {mb:.2f} MB in {seconds} s")
    return {"mb": mb, "report": report, "seconds": seconds}
