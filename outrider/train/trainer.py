"""Online drafter training: the target runs alongside the drafter, nothing is cached to disk.

Each step takes a batch of token windows, runs the frozen target once over them (tapped hidden
states + its own next-token distributions), samples anchors and trains the drafter on DeepSpec's
objective with AdamW, linear warm-up and cosine decay. Trainable weights are kept in float32
(master copies); the forward runs in the compute dtype (bf16 on a GPU target). Checkpoints under
OUT/checkpoints/ make a run resumable; the result is a DeepSpec-packaged drafter in OUT.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..api import load_drafter, load_target
from ..core.checkpoint import read_config
from ..core.errors import OutriderError
from ..core.plugins import Plugins
from ..core.target import Target
from ..plugins.strategies.block_drafter import BlockDrafter
from . import data as D
from .objectives import (
    Batch,
    LossWeights,
    check_block_forward,
    gather_rows,
    losses,
    sample_anchors,
    slot_positions,
)
from .package import (
    default_layers,
    default_taps,
    drafter_config,
    initial_weights,
    save_drafter,
    spec_from,
)
from .report import Acceptance, acceptance, checkpoint_acceptance, plain_outputs

Event = dict[str, Any]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
FROZEN = ("embed_tokens", "lm_head")  # DeepSpec: copies of the target's, never trained


@dataclass
class TrainConfig:
    """Everything `outrider train` takes; the defaults follow DeepSpec where they can."""

    model: str
    data: list[str]
    out: str
    kind: str = "dspark"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 6e-4
    warmup: int | None = None  # default: 4% of the steps
    block_size: int = 7
    layers: int | None = None  # default: from the target's depth
    init: str | None = None
    max_new_tokens: int = 256
    regenerate: bool = True
    continue_text: bool = False  # documents are self-distilled too (the target continues them)
    thinking: bool | None = None
    held_out: int = 8
    seed: int = 42
    resume: bool = False
    anchors: int | None = None  # per window; default seq_len // 8 (DeepSpec: 512 per 4096)
    markov_rank: int = 256
    markov_type: str = "vanilla"
    dtype: str = "auto"  # auto = the target's own (float32 stays float32, bf16 stays bf16)
    eval_every: int = 0  # 0: before and after training only
    eval_tokens: int = 128
    save_every: int = 0  # 0: every 10% of the steps
    log_every: int = 10
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    compile: bool = True

    def check(self) -> None:
        if self.kind not in ("dspark", "dflash"):
            raise OutriderError(f"--kind must be dspark or dflash, got {self.kind!r}")
        for name in ("steps", "batch_size", "block_size", "eval_tokens", "log_every"):
            if getattr(self, name) < 1:
                raise OutriderError(f"--{name.replace('_', '-')} must be >= 1")
        if self.seq_len < 16:
            raise OutriderError(f"--seq-len must be >= 16, got {self.seq_len}")
        if self.lr <= 0:
            raise OutriderError(f"--lr must be > 0, got {self.lr}")
        if self.warmup is not None and not 0 <= self.warmup < self.steps:
            raise OutriderError(f"--warmup must be in [0, --steps), got {self.warmup}")
        if self.layers is not None and self.layers < 1:
            raise OutriderError(f"--layers must be >= 1, got {self.layers}")
        if self.max_new_tokens < 1:
            raise OutriderError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise OutriderError(f"--dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.markov_type not in ("vanilla", "gated", "rnn"):
            raise OutriderError("--markov-type must be vanilla, gated or rnn")
        if not self.data:
            raise OutriderError("--data is required (a jsonl, text file or folder)")


@dataclass
class TrainReport:
    out: str
    kind: str
    steps: int
    windows: int
    held_out_prompts: int
    seconds: float
    tokens_per_second: float
    final_loss: float
    init: dict
    trained: dict
    lossless: bool
    evals: list[dict] = field(default_factory=list)

    @property
    def accept_init(self) -> float:
        return self.init["mean_accept_len"]

    @property
    def accept_trained(self) -> float:
        return self.trained["mean_accept_len"]

    def to_json(self) -> dict:
        return asdict(self)


class _Windows:
    """The training windows as padded arrays, in a reproducible per-epoch order."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, seed: int) -> None:
        self.ids, self.mask, self.seed = ids, mask, seed
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_sequences(cls, seqs: list[D.Sequence], seq_len: int, seed: int) -> _Windows:
        ids = np.zeros((len(seqs), seq_len), dtype=np.int32)
        mask = np.zeros((len(seqs), seq_len), dtype=bool)
        for i, s in enumerate(seqs):
            ids[i, : len(s.ids)] = s.ids
            mask[i, : len(s.mask)] = np.array(s.mask, dtype=bool)
        return cls(ids, mask, seed)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        rows = []
        for p in range(step * size, (step + 1) * size):
            epoch = p // n
            if epoch not in self._orders:
                self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(n)
            rows.append(self._orders[epoch][p % n])
        return self.ids[rows], self.mask[rows]


def _schedule(cfg: TrainConfig) -> Callable:
    warmup = int(0.04 * cfg.steps) if cfg.warmup is None else cfg.warmup
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warmup))
    if warmup == 0:
        return decay
    ramp = optim.linear_schedule(cfg.lr / warmup, cfg.lr, warmup)
    return optim.join_schedules([ramp, decay], [warmup])


def _compute_dtype(cfg: TrainConfig, weights: dict[str, mx.array]) -> mx.Dtype:
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    dtype = weights["embed_tokens.weight"].dtype
    return mx.float32 if dtype == mx.float32 else mx.bfloat16


class _Run:
    """One training run's state: the drafter, its float32 master weights, the optimizer."""

    def __init__(self, cfg: TrainConfig, target: Target, config: dict, weights: dict) -> None:
        self.cfg, self.target, self.config = cfg, target, config
        self.dtype = _compute_dtype(cfg, weights)
        spec = spec_from(config, weights)
        self.spec = spec
        self.model = BlockDrafter(spec)
        self.model.load_weights(list(spec.weights.items()), strict=True)
        self.model.set_dtype(self.dtype)
        for name in FROZEN:
            self.model[name].freeze()
        diff = check_block_forward(self.model)
        if diff > (1e-3 if self.dtype == mx.float32 else 0.1):
            raise OutriderError(
                f"the batched training forward disagrees with the inference forward on this "
                f"device (max |difference| {diff:.3g}); training here would teach the drafter "
                f"positions it never sees at inference (mlx {mx.__version__})"
            )
        self.master = {
            "params": tree_map(lambda a: a.astype(mx.float32), self.model.trainable_parameters())
        }
        self.weights_for_loss = LossWeights.for_kind(cfg.kind, spec.confidence_head)
        # torch-style AdamW (bias-corrected), as DeepSpec trains
        self.optimizer = optim.AdamW(
            _schedule(cfg), weight_decay=cfg.weight_decay, bias_correction=True
        )
        self.optimizer.init(self.master["params"])
        self.n_anchors = cfg.anchors or max(1, cfg.seq_len // 8)
        self._step_fn = self._make_step()

    def _make_step(self) -> Callable:
        model, dtype, mask_id = self.model, self.dtype, self.spec.mask_token_id
        weights, clip = self.weights_for_loss, self.cfg.grad_clip

        def loss_fn(params, arrays):
            model.update(tree_map(lambda a: a.astype(dtype), params))
            return losses(model, Batch(*arrays), mask_id, weights)

        grad_fn = mx.value_and_grad(loss_fn)

        def step(arrays):
            (loss, parts), grads = grad_fn(self.master["params"], arrays)
            if clip > 0:
                grads, _ = optim.clip_grad_norm(grads, clip)
            self.master["params"] = self.optimizer.apply_gradients(grads, self.master["params"])
            return loss, parts

        if not self.cfg.compile:
            return step
        state = [self.master, self.optimizer.state, self.model.state]
        return partial(mx.compile, inputs=state, outputs=state)(step)

    def make_batch(self, ids_np: np.ndarray, mask_np: np.ndarray, step: int) -> Batch:
        """Run the target over the windows and gather what the loss needs."""
        ids = mx.array(ids_np)
        logits, taps = self.target.forward_batch(ids, tuple(self.spec.target_layer_ids))
        rng = np.random.default_rng([self.cfg.seed, step, 1])
        anchors_np, keep_np = sample_anchors(mask_np, self.n_anchors, rng)
        anchors = mx.array(anchors_np)
        rows = gather_rows(logits, slot_positions(anchors, self.spec.block_size))
        probs = mx.softmax(rows.astype(mx.float32), axis=-1)
        return Batch(
            ids,
            mx.array(mask_np.astype(np.int32)),
            mx.stop_gradient(taps.astype(self.dtype)),
            mx.stop_gradient(probs),
            anchors,
            mx.array(keep_np),
        )

    def step(self, batch: Batch) -> tuple[mx.array, dict]:
        """Queue one optimizer step on the device (the caller reads the loss when it needs it,
        so the next batch is prepared while this step runs)."""
        arrays = (batch.ids, batch.mask, batch.taps, batch.target_probs, batch.anchors, batch.keep)
        loss, parts = self._step_fn(arrays)
        mx.async_eval(loss, parts, self.master, self.optimizer.state)
        return loss, parts

    def weights(self) -> dict[str, mx.array]:
        """All drafter tensors under DeepSpec's names: trained masters plus frozen copies."""
        out = dict(tree_flatten(self.model.parameters()))
        out.update(tree_flatten(self.master["params"]))
        return out

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, step: int, extra: dict) -> None:
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "trainable.safetensors"), dict(tree_flatten(self.master)))
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state))
        )
        (tmp / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)

    def load_checkpoint(self, folder: Path) -> dict:
        master = mx.load(str(folder / "trainable.safetensors"))
        self.master.update(tree_unflatten(list(master.items())))
        state = mx.load(str(folder / "optimizer.safetensors"))
        self.optimizer.state.update(tree_unflatten(list(state.items())))
        return json.loads((folder / "state.json").read_text())


def _latest_checkpoint(root: Path) -> Path | None:
    steps = sorted(root.glob("step_*[0-9]"), key=lambda p: int(p.name.split("_")[1]))
    return steps[-1] if steps else None


def _prune_checkpoints(root: Path, keep: int = 2) -> None:
    steps = sorted(root.glob("step_*[0-9]"), key=lambda p: int(p.name.split("_")[1]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _windows(
    cfg: TrainConfig, target: Target, train: list[D.Record], root: Path, emit: Callable
) -> _Windows:
    """Tokenised (and self-distilled) training windows; kept under checkpoints/ for --resume."""
    saved = root / "windows.safetensors"
    if cfg.resume and saved.is_file():
        arrays = mx.load(str(saved))
        ids, mask = np.array(arrays["ids"]), np.array(arrays["mask"]).astype(bool)
        if ids.shape[1] == cfg.seq_len:
            emit({"event": "data", "windows": int(ids.shape[0]), "reused": True})
            return _Windows(ids, mask, cfg.seed)
    generate = D.greedy_generator(target, cfg.max_new_tokens) if cfg.regenerate else None
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        emit({"event": "regenerate", "done": done, "total": total})

    seqs = D.build_sequences(
        train,
        target.tokenizer,
        generate,
        cfg.thinking,
        progress,
        continue_text=cfg.seq_len if cfg.continue_text else 0,
    )
    wins = D.windows(seqs, cfg.seq_len)
    if not wins:
        raise OutriderError(
            f"--data yields no training window with {D.MIN_SUPERVISED}+ supervised tokens "
            f"(sequences of {cfg.seq_len} tokens)"
        )
    out = _Windows.from_sequences(wins, cfg.seq_len, cfg.seed)
    root.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(saved), {"ids": mx.array(out.ids), "mask": mx.array(out.mask.astype(np.int32))}
    )
    emit(
        {
            "event": "data",
            "windows": len(out),
            "tokens": int(out.mask.sum()),
            "seconds": round(time.perf_counter() - started, 2),
            "reused": False,
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
                "drafters (DSpark / DFlash)"
            )
        if spec.kind != cfg.kind:
            raise OutriderError(f"--init {cfg.init} is a {spec.kind} drafter, not {cfg.kind}")
        from ..core.hub import resolve_model

        config = read_config(resolve_model(cfg.init, "drafter", True))
        return config, dict(spec.weights)
    hidden = target.hidden_size
    layers = cfg.layers or default_layers(target.num_layers)
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


def train_drafter(cfg: TrainConfig, on_event: Callable[[Event], None] | None = None) -> TrainReport:
    """Train a DSpark / DFlash drafter for `cfg.model` and write it to `cfg.out`."""
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
    prompts = D.held_out_prompts(held, target.tokenizer, cfg.thinking)

    init_dir = root / "init"
    if cfg.resume and (init_dir / "config.json").is_file():
        spec = load_drafter(plugins, str(init_dir), download=False)
        config, weights = read_config(init_dir), dict(spec.weights)
    else:
        config, weights = _new_or_init(cfg, target, plugins)
        save_drafter(init_dir, config, weights, _compute_dtype(cfg, weights))
    target.install_taps(tuple(config["target_layer_ids"]))
    wins = _windows(cfg, target, train, root, emit)

    run = _Run(cfg, target, config, weights)
    start_step, state = 0, {}
    latest = _latest_checkpoint(root) if cfg.resume else None
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

    save_every = cfg.save_every or max(1, cfg.steps // 10)
    started = time.perf_counter()
    tokens = 0
    window_t0, window_tokens = time.perf_counter(), 0
    loss_value = float("nan")
    emit({"event": "start", "steps": cfg.steps, "from_step": start_step, "windows": len(wins)})

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
            n_tok = cfg.batch_size * cfg.seq_len
            tokens += n_tok
            window_tokens += n_tok
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
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps and prompts:
                spec = spec_from(config, run.weights())
                acc = acceptance(target, spec, prompts, cfg.eval_tokens, plugins).to_json()
                evals.append({"step": done, **acc})
                emit({"event": "eval", "step": done, "which": "trained", **acc})
            if done % save_every == 0 or done == cfg.steps:
                run.save_checkpoint(
                    root / f"step_{done:07d}", done, {"init": init_acc, "evals": evals}
                )
                _prune_checkpoints(root)
                emit({"event": "checkpoint", "step": done})
    except KeyboardInterrupt:
        mx.eval(run.master, run.optimizer.state)
        done = int(run.optimizer.state["step"].item())  # updates applied so far
        run.save_checkpoint(root / f"step_{done:07d}", done, {"init": init_acc, "evals": evals})
        raise OutriderError(
            f"interrupted after step {done}: checkpoint saved; run again with --resume"
        ) from None
    seconds = time.perf_counter() - started

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
