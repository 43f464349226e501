"""Online drafter training: the target runs alongside the drafter, nothing is cached to disk.

Each step takes a batch of token windows, runs the frozen target once over them (tapped hidden
states + its own next-token distributions), samples anchors and trains the drafter on DeepSpec's
objective with AdamW, linear warm-up and cosine decay. Trainable weights are kept in float32
(master copies); the forward runs in the compute dtype (bf16 on a GPU target). Checkpoints under
OUT/checkpoints/ make a run resumable; the result is a DeepSpec-packaged drafter in OUT.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..core.checkpoint import read_config
from ..core.errors import Interrupted, OutriderError
from ..core.hub import resolve_model
from ..core.plugins import Plugins
from ..core.target import Target
from ..loaders import load_drafter, load_target
from . import data as D
from .config import TrainConfig, TrainReport
from .objectives import Batch
from .package import (
    default_layers,
    default_taps,
    drafter_config,
    initial_weights,
    save_drafter,
    spec_from,
)
from .report import Acceptance, acceptance, checkpoint_acceptance, plain_outputs
from .run import DrafterRun, compute_dtype, latest_checkpoint, prune_checkpoints
from .teacher import greedy_generator, teacher_target

__all__ = ["TrainConfig", "TrainReport", "train_drafter"]

Event = dict[str, Any]


def _made_for(cfg: TrainConfig, target: Target, train: list[D.Record]) -> dict:
    """What the self-distilled answers depend on (the manifest kept with them): a resume that
    differs in any of these must not reuse them."""
    config = json.dumps(target.config, sort_keys=True, default=str)
    return {
        "model": cfg.model,
        "model_config": hashlib.sha256(config.encode("utf-8")).hexdigest(),
        "data": D.records_digest(train),
        "max_new_tokens": cfg.max_new_tokens,
        "thinking": cfg.thinking,
        "continue_text": cfg.continue_text,
        # documents' prompts are cut from --seq-len windows; chats' answers do not depend on it
        "seq_len": cfg.seq_len if cfg.continue_text else None,
        "chunk": cfg.distill_chunk,
    }


def _kept_windows(cfg: TrainConfig, saved: Path, made_for: dict) -> D.Windows | None:
    """The windows an earlier run of the same settings saved, if any."""
    if not (cfg.resume and saved.is_file()):
        return None
    arrays, meta = mx.load(str(saved), return_metadata=True)
    ids, mask = np.array(arrays["ids"]), np.array(arrays["mask"]).astype(bool)
    if ids.shape[1] != cfg.seq_len:
        return None
    # windows saved before they carried a manifest are trusted as they were (same length)
    if "made_for" in meta and json.loads(meta["made_for"]) != made_for:
        return None
    return D.Windows(ids, mask, cfg.seed)


def _windows(
    cfg: TrainConfig, teacher: Target, train: list[D.Record], root: Path, emit: Callable
) -> D.Windows:
    """Tokenised (and self-distilled) training windows; kept under checkpoints/ for --resume,
    and the teacher's answers kept chunk by chunk under checkpoints/distill/ as they come.
    The teacher shares the target's config and tokenizer, so what they were made for is the
    target's."""
    saved = root / "windows.safetensors"
    made_for = _made_for(cfg, teacher, train)
    window_key = {**made_for, "seq_len": cfg.seq_len, "regenerate": cfg.regenerate}
    kept = _kept_windows(cfg, saved, window_key)
    if kept is not None:
        emit({"event": "data", "windows": len(kept), "reused": True})
        return kept
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        emit({"event": "regenerate", "done": done, "total": total})

    ask = None
    if cfg.regenerate:
        store = D.AnswerStore.open(root / "distill", made_for, cfg.resume)
        generate = greedy_generator(teacher, cfg.max_new_tokens, batch_size=cfg.distill_chunk)
        ask = D.Answers(generate, store, progress)
    try:
        seqs = D.build_sequences(
            train,
            teacher.tokenizer,
            ask,
            cfg.thinking,
            continue_text=cfg.seq_len if cfg.continue_text else 0,
            chunk=cfg.distill_chunk,
        )
    except KeyboardInterrupt:
        if ask is None:
            raise
        folder = root / "distill"
        chunks = D.AnswerStore.kept_chunks(folder)
        raise Interrupted(
            f"during self-distillation: the answers to {ask.kept} prompts ({chunks} chunks) are "
            f"kept in {folder}; run again with --resume to continue the self-distillation"
        ) from None
    wins = D.windows(seqs, cfg.seq_len)
    if not wins:
        raise OutriderError(
            f"--data yields no training window with {D.MIN_SUPERVISED}+ supervised tokens "
            f"(sequences of {cfg.seq_len} tokens)"
        )
    out = D.Windows.from_sequences(wins, cfg.seq_len, cfg.seed)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / "windows.tmp.safetensors"
    mx.save_safetensors(
        str(tmp),
        {"ids": mx.array(out.ids), "mask": mx.array(out.mask.astype(np.int32))},
        metadata={"made_for": json.dumps(window_key, sort_keys=True)},
    )
    tmp.replace(saved)
    emit(
        {
            "event": "data",
            "windows": len(out),
            "tokens": int(out.mask.sum()),
            "seconds": round(time.perf_counter() - started, 2),
            "reused": False,
            **({"answers_reused": ask.reused} if ask is not None and ask.reused else {}),
        }
    )
    return out


def _new_or_init(cfg: TrainConfig, target: Target, plugins: Plugins) -> tuple[dict, dict]:
    """(config, weights) to start from: --init's drafter, or a fresh one for the target."""
    if cfg.init is not None:
        spec = load_drafter(plugins, cfg.init)
        if spec.format != "deepspec":
            raise OutriderError(
                f"--init {cfg.init} is a {spec.format} drafter; outrider trains DeepSpec-packaged "
                "drafters (DSpark / DFlash / EAGLE-3)"
            )
        if spec.kind != cfg.kind:
            raise OutriderError(f"--init {cfg.init} is a {spec.kind} drafter, not {cfg.kind}")
        config = read_config(resolve_model(cfg.init, "drafter", True))
        return config, dict(spec.weights)
    hidden = target.hidden_size
    layers = cfg.layers or (1 if cfg.kind == "eagle3" else default_layers(target.num_layers))
    config = drafter_config(
        target,
        cfg.kind,
        num_layers=layers,
        block_size=cfg.block_size,
        tap_ids=default_taps(target.num_layers),
        markov_rank=min(cfg.markov_rank, hidden),
        markov_type=cfg.markov_type,
        num_anchors=cfg.anchors or max(1, cfg.seq_len // 8),
    )
    return config, initial_weights(config, target, cfg.seed)


def _steps(
    cfg: TrainConfig,
    run: DrafterRun,
    wins: D.Windows,
    start_step: int,
    emit: Callable[[Event], None],
    evaluate: Callable[[int], None] | None,
    checkpoint: Callable[[int, dict], Path],
    before: dict | None = None,
) -> tuple[float, float, int]:
    """Optimizer steps start_step..cfg.steps -> (last loss, seconds, window tokens seen), all
    counted over the whole training: `before` is what the checkpoint it resumes from says
    (`loss`, `seconds`, `tokens`), and every checkpoint is given the totals so far.

    The next batch's target forward is queued while the current step runs. Ctrl-C saves a
    checkpoint at the last applied update and says where it is and how to resume.
    """
    before = before or {}
    save_every = cfg.save_every or max(1, cfg.steps // 10)
    started = window_t0 = time.perf_counter()
    earlier = float(before.get("seconds") or 0.0)
    tokens = int(before.get("tokens") or 0)
    window_tokens = 0
    loss_value = float("nan") if before.get("loss") is None else float(before["loss"])
    emit({"event": "start", "steps": cfg.steps, "from_step": start_step, "windows": len(wins)})

    def totals() -> dict:
        loss = None if math.isnan(loss_value) else loss_value
        seconds = earlier + time.perf_counter() - started
        return {"loss": loss, "seconds": round(seconds, 3), "tokens": tokens}

    def prepare(step: int) -> Batch:
        batch = run.make_batch(*wins.batch(step, cfg.batch_size), step)
        mx.async_eval(batch.taps, batch.target_probs)
        return batch

    pending = prepare(start_step) if start_step < cfg.steps else None
    try:
        for step in range(start_step, cfg.steps):
            loss, parts = run.step(pending)
            if step + 1 < cfg.steps:
                pending = prepare(step + 1)  # the target's next forward queues behind this step
            loss_value = loss.item()
            tokens += cfg.batch_size * cfg.seq_len
            window_tokens += cfg.batch_size * cfg.seq_len
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps or done == start_step + 1:
                now = time.perf_counter()
                emit(
                    {
                        "event": "step",
                        "step": done,
                        "steps": cfg.steps,
                        "loss": round(loss_value, 5),
                        **{k: round(float(v.item()), 5) for k, v in parts.items()},
                        "lr": float(run.optimizer.learning_rate.item()),
                        "tokens_per_s": round(window_tokens / max(now - window_t0, 1e-9), 1),
                    }
                )
                window_t0, window_tokens = now, 0
            if evaluate and cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                evaluate(done)
            if done % save_every == 0 or done == cfg.steps:
                checkpoint(done, totals())
                emit({"event": "checkpoint", "step": done})
    except KeyboardInterrupt:
        mx.eval(run.master, run.optimizer.state)
        done = int(run.optimizer.state["step"].item())  # updates applied so far
        saved = checkpoint(done, totals())
        raise Interrupted(
            f"after step {done}: checkpoint saved in {saved}; run again with --resume"
        ) from None
    return loss_value, earlier + time.perf_counter() - started, tokens


def train_drafter(cfg: TrainConfig, on_event: Callable[[Event], None] | None = None) -> TrainReport:
    """Train a DSpark / DFlash / EAGLE-3 drafter for `cfg.model` and write it to `cfg.out`."""
    cfg.check()
    emit = on_event or (lambda e: None)
    out = Path(cfg.out)
    root = out / "checkpoints"
    if out.exists() and any(out.iterdir()) and not cfg.resume:
        if (out / "model.safetensors").exists() or root.exists():
            raise OutriderError(f"--out {out} already holds a training run: pass --resume")
    plugins = Plugins()
    records = D.read_records(cfg.data)
    train, held = D.split_held_out(records, cfg.held_out, cfg.seed)
    target = load_target(plugins, cfg.model)
    teacher = teacher_target(target)  # answers and runs the training forwards
    prompts = D.held_out_prompts(held, target.tokenizer, cfg.thinking)

    init_dir = root / "init"
    if cfg.resume and (init_dir / "config.json").is_file():
        spec = load_drafter(plugins, str(init_dir), download=False)
        config, weights = read_config(init_dir), dict(spec.weights)
    else:
        config, weights = _new_or_init(cfg, target, plugins)
        save_drafter(init_dir, config, weights, compute_dtype(cfg, weights))
    teacher.install_taps(tuple(config["target_layer_ids"]))
    wins = _windows(cfg, teacher, train, root, emit)
    mx.clear_cache()  # the self-distillation's batched caches: another run may share the device

    run = DrafterRun(cfg, teacher, config, weights)
    start_step, state = 0, {}
    latest = latest_checkpoint(root) if cfg.resume else None
    if latest is not None:
        state = run.load_checkpoint(latest)
        start_step = int(state["step"])
        emit({"event": "resume", "step": start_step, "checkpoint": str(latest)})
    init_acc = state.get("init")
    if init_acc is None and prompts:
        init_acc = checkpoint_acceptance(target, init_dir, prompts, cfg.eval_tokens).to_json()
    init_acc = init_acc or {"mean_accept_len": 0.0}
    emit({"event": "eval", "step": 0, "which": "init", **init_acc})
    evals = list(state.get("evals", []))

    def evaluate(done: int) -> None:
        spec = spec_from(config, run.weights())
        acc = acceptance(target, spec, prompts, cfg.eval_tokens, plugins).to_json()
        evals.append({"step": done, **acc})
        emit({"event": "eval", "step": done, "which": "trained", **acc})

    def checkpoint(done: int, totals: dict) -> Path:
        folder = root / f"step_{done:07d}"
        run.save_checkpoint(folder, done, {"init": init_acc, "evals": evals, **totals})
        prune_checkpoints(root)
        return folder

    # loss, seconds and tokens count the whole training, across resumes (the checkpoint keeps
    # them), so a run resumed at its last step still reports them
    loss_value, seconds, tokens = _steps(
        cfg, run, wins, start_step, emit, evaluate if prompts else None, checkpoint, state
    )

    save_drafter(out, config, run.weights(), run.dtype)
    trained = Acceptance(0.0, 0, 0)
    lossless = True
    if prompts:
        trained = checkpoint_acceptance(target, out, prompts, cfg.eval_tokens, plugins)
        lossless = trained.outputs == plain_outputs(target, prompts, cfg.eval_tokens)
    trained_json = trained.to_json()
    emit({"event": "eval", "step": cfg.steps, "which": "trained", **trained_json})
    report = TrainReport(
        out=str(out),
        kind=cfg.kind,
        steps=cfg.steps,
        windows=len(wins),
        held_out_prompts=len(prompts),
        seconds=round(seconds, 3),
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else 0.0,
        final_loss=loss_value,
        init=init_acc,
        trained=trained_json,
        lossless=lossless,
        evals=evals,
    )
    (out / "train_report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    emit({"event": "done", **report.to_json()})
    return report
