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
    by the host's kernel launches, so two runs share one GPU (or CPU) well."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # a fresh MLX per child, no forked device state
    kinds = ("dspark", "dflash")
    with ProcessPoolExecutor(len(kinds), mp_context=ctx) as pool:
        jobs = {k: pool.submit(drafter_job, k, target, data, out / k, p, seed) for k in kinds}
        return {k: job.result() for k, job in jobs.items()}


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
