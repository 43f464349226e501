"""One training run's device state: the drafter, its float32 master weights, AdamW, the
compiled step, and checkpoints of all three."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..core.device import on_cuda_gpu
from ..core.errors import OutriderError
from ..core.target import Target
from . import objectives as block
from . import ttt
from .config import DTYPES, TrainConfig
from .objectives import Batch, LossWeights, gather_rows
from .package import network, spec_from

FROZEN = ("embed_tokens", "lm_head")  # DeepSpec: copies of the target's, never trained


def schedule(cfg: TrainConfig) -> Callable:
    """Linear warm-up (default 4% of the steps, as DeepSpec) then cosine decay to 0."""
    warmup = int(0.04 * cfg.steps) if cfg.warmup is None else cfg.warmup
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warmup))
    if warmup == 0:
        return decay
    ramp = optim.linear_schedule(cfg.lr / warmup, cfg.lr, warmup)
    return optim.join_schedules([ramp, decay], [warmup])


def compute_dtype(cfg: TrainConfig, weights: dict[str, mx.array]) -> mx.Dtype:
    """--dtype, or auto: float32 for a float32 target, else bf16 (fp16 trains poorly)."""
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    dtype = weights["embed_tokens.weight"].dtype
    return mx.float32 if dtype == mx.float32 else mx.bfloat16


class DrafterRun:
    """One training run's state: the drafter, its float32 master weights, the optimizer."""

    def __init__(self, cfg: TrainConfig, target: Target, config: dict, weights: dict) -> None:
        self.cfg, self.target, self.config = cfg, target, config
        self.dtype = compute_dtype(cfg, weights)
        spec = spec_from(config, weights)
        self.spec = spec
        self.chain = spec.kind == "eagle3"  # EAGLE-3's TTT chain, else a block drafter
        self.depth = spec.ttt_length if self.chain else spec.block_size
        self.model = network(spec)
        self.model.load_weights(list(spec.weights.items()), strict=True)
        self.model.set_dtype(self.dtype)
        for name in FROZEN:
            self.model[name].freeze()
        # Relative bounds: MLX's CUDA backend runs float32 matmuls in TF32 (a 10-bit mantissa,
        # ~1e-3 relative, seen on an H200); a position or mask mismatch is off by order one.
        check = ttt.check_chain_forward if self.chain else block.check_block_forward
        diff = check(self.model)
        if diff > (1e-2 if self.dtype == mx.float32 else 0.1):
            raise OutriderError(
                f"the batched training forward disagrees with the inference forward on this "
                f"device (max relative difference {diff:.3g}); training here would teach the drafter "
                f"positions it never sees at inference (mlx {mx.__version__})"
            )
        self.master = {
            "params": tree_map(lambda a: a.astype(mx.float32), self.model.trainable_parameters())
        }
        self.weights_for_loss = LossWeights.for_kind(cfg.kind, spec.confidence_head)
        # torch-style AdamW (bias-corrected), as DeepSpec trains
        self.optimizer = optim.AdamW(
            schedule(cfg), weight_decay=cfg.weight_decay, bias_correction=True
        )
        self.optimizer.init(self.master["params"])
        self.n_anchors = cfg.anchors or max(1, cfg.seq_len // 8)
        self._step_fn = self._make_step()

    def _make_step(self) -> Callable:
        model, dtype, mask_id = self.model, self.dtype, self.spec.mask_token_id
        weights, clip = self.weights_for_loss, self.cfg.grad_clip

        chain, depth = self.chain, self.depth

        def loss_fn(params, arrays):
            model.update(tree_map(lambda a: a.astype(dtype), params))
            if chain:
                return ttt.losses(model, Batch(*arrays), depth)
            return block.losses(model, Batch(*arrays), mask_id, weights)

        grad_fn = mx.value_and_grad(loss_fn)

        def step(arrays):
            (loss, parts), grads = grad_fn(self.master["params"], arrays)
            if clip > 0:
                grads, _ = optim.clip_grad_norm(grads, clip)
            self.master["params"] = self.optimizer.apply_gradients(grads, self.master["params"])
            return loss, parts

        if not self.cfg.compile or self.compile_stalls():
            return step
        state = [self.master, self.optimizer.state, self.model.state]
        return partial(mx.compile, inputs=state, outputs=state)(step)

    def compile_stalls(self) -> bool:
        """The compiled DSpark step stalled on MLX's CUDA backend (H200, mlx 0.32.4: one step in
        200 s, where the same step uncompiled runs ~25 steps/s), so DSpark trains uncompiled on
        a CUDA GPU; DFlash's compiled step is fine there. EAGLE-3's compiled step has not been
        tried there, so it trains uncompiled too."""
        on_cuda = on_cuda_gpu()
        return on_cuda and self.cfg.kind in ("dspark", "eagle3")

    def make_batch(self, ids_np: np.ndarray, mask_np: np.ndarray, step: int) -> Batch:
        """Run the target over the windows and gather what the loss needs."""
        ids = mx.array(ids_np)
        logits, taps = self.target.forward_batch(ids, tuple(self.spec.target_layer_ids))
        rng = np.random.default_rng([self.cfg.seed, step, 1])
        sample = ttt.chain_anchors if self.chain else block.sample_anchors
        anchors_np, keep_np = sample(mask_np, self.n_anchors, rng)
        anchors = mx.array(anchors_np)
        where = ttt.target_positions if self.chain else block.slot_positions
        rows = gather_rows(logits, where(anchors, self.depth))
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


def latest_checkpoint(root: Path) -> Path | None:
    steps = sorted(root.glob("step_*[0-9]"), key=lambda p: int(p.name.split("_")[1]))
    return steps[-1] if steps else None


def prune_checkpoints(root: Path, keep: int = 2) -> None:
    steps = sorted(root.glob("step_*[0-9]"), key=lambda p: int(p.name.split("_")[1]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
