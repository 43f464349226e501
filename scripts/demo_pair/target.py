"""Stages 3-4: the target, trained from scratch with mlx-lm's trainer, then quantised."""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

from .corpus import documents, pack, stdlib_sources, training_pairs, write_corpus
from .presets import Preset, log
from .summary import folder_mb
from .tokenizer import train_tokenizer


def target_config(p: Preset, tokenizer) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "intermediate_size": p.intermediate_size,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "torch_dtype": p.dtype,
    }


class Budget:
    """Ends mlx-lm's training loop when the time budget is spent (the batches stop coming)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.stopped_at = seconds, time.perf_counter(), None

    def batches(self, iterate):
        def wrapped(*args, **kwargs):
            for i, batch in enumerate(iterate(*args, **kwargs)):
                if kwargs.get("loop") and time.perf_counter() - self.start > self.seconds:
                    self.stopped_at = i
                    return
                yield batch

        return wrapped


class Losses:
    """mlx-lm training callback that keeps the reported losses for the summary."""

    def __init__(self) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.tokens_per_second = 0.0

    def on_train_loss_report(self, info: dict) -> None:
        self.train.append((info["iteration"], info["train_loss"]))
        self.tokens_per_second = info["tokens_per_second"]

    def on_val_loss_report(self, info: dict) -> None:
        self.val.append((info["iteration"], info["val_loss"]))


def train_target(p: Preset, config: dict, train_set, valid_set, work: Path, seed: int):
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.models import qwen3
    from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches, train

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    decay = optim.cosine_decay(p.lr, max(1, p.steps - p.warmup), p.lr * 0.1)
    warm = optim.linear_schedule(p.lr * 0.01, p.lr, max(1, p.warmup))
    schedule = optim.join_schedules([warm, decay], [p.warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    args = TrainingArgs(
        batch_size=p.batch_size,
        iters=p.steps,
        val_batches=8,
        steps_per_report=max(1, p.steps // 20),
        steps_per_eval=max(1, p.steps // 4),
        steps_per_save=p.steps + 1,
        max_seq_length=p.seq_len + 1,
        adapter_file=str(work / "target-float.safetensors"),
    )
    losses, budget = Losses(), Budget(p.minutes * 60)
    train(
        model,
        optimizer,
        train_set,
        valid_set,
        args=args,
        iterate_batches=budget.batches(iterate_batches),
        training_callback=losses,
    )
    return model, losses, budget


def val_loss(model, valid_set, p: Preset) -> float:
    from mlx_lm.tuner.trainer import evaluate

    return evaluate(model, valid_set, p.batch_size, 8, max_seq_length=p.seq_len + 1)


def quantize_and_save(model, config: dict, p: Preset, out: Path) -> dict:
    """Cast to the preset's dtype, quantise with mlx-lm, save as a normal mlx-lm folder."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model

    dtype = getattr(mx, p.dtype)
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    model, config = quantize_model(model, config, group_size=64, bits=p.bits)
    save_model(out, model)
    save_config(config, out / "config.json")
    return config


def make_target(args: argparse.Namespace, p: Preset, out: Path, work: Path):
    """Stages 1-4: corpus, tokenizer, target training, quantisation. Returns the summary so
    far and the training chat pairs (the drafters' prompts come from them)."""
    (out / "target").mkdir(parents=True)
    times: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        times[name] = round(now - since, 2)
        return now

    t = time.perf_counter()
    files = stdlib_sources(p.corpus_bytes)
    manifest = write_corpus(work, files)
    shutil.copy(work / "corpus" / "manifest.json", out / "target" / "corpus.json")
    if (work / "corpus" / "LICENSE-PSF.txt").is_file():
        shutil.copy(work / "corpus" / "LICENSE-PSF.txt", out / "target" / "CORPUS-LICENSE.txt")
    log(f"corpus: {manifest['files']} stdlib files, {manifest['bytes'] / 1e6:.1f} MB (PSF-2.0)")
    tokenizer = train_tokenizer([t for _, t in files], p.vocab_size, out / "target")
    t = lap("tokenizer", t)
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens ({times['tokenizer']} s)")

    train_texts, valid_texts, pairs = documents(files, tokenizer, args.seed)
    train_set = pack(train_texts, tokenizer, p.seq_len)
    valid_set = pack(valid_texts, tokenizer, p.seq_len)
    if len(train_set) < p.batch_size or len(valid_set) < p.batch_size:
        sys.exit("error: the corpus is too small for one batch; raise corpus_bytes")
    tokens = len(train_set) * (p.seq_len + 1)
    log(f"data: {tokens:,} training tokens ({len(pairs)} chat examples), {len(valid_set)} val rows")
    t = lap("data", t)

    config = target_config(p, tokenizer)
    model, losses, budget = train_target(p, config, train_set, valid_set, work, args.seed)
    float_loss = val_loss(model, valid_set, p)
    t = lap("target_training", t)
    steps_done = budget.stopped_at if budget.stopped_at is not None else p.steps
    log(f"target: {steps_done} steps in {times['target_training']} s, val loss {float_loss:.3f}")
    if budget.stopped_at is not None:
        log(f"target: time budget of {p.minutes} min reached at step {steps_done}")

    quantize_and_save(model, config, p, out / "target")
    from mlx_lm.utils import load

    from outrider.core.device import dense_single_groups

    qmodel, _ = load(str(out / "target"))
    dense_single_groups(qmodel)  # MLX's wrong CUDA kernel for one-group rows (core/device.py)
    quant_loss = val_loss(qmodel, valid_set, p)
    t = lap("quantise", t)
    log(f"target: {p.bits}-bit, val loss {quant_loss:.3f} ({folder_mb(out / 'target'):.2f} MB)")
    first_val = losses.val[0][1] if losses.val else math.nan
    summary = {
        "corpus": manifest,
        "vocab_size": len(tokenizer),
        "target_steps": steps_done,
        "target_tokens_per_second": round(losses.tokens_per_second, 1),
        "train_loss": [(i, round(v, 4)) for i, v in losses.train],
        "val_loss_start": round(first_val, 4),
        "val_loss_float": round(float_loss, 4),
        "val_loss_quantized": round(quant_loss, 4),
        "seconds": times,
    }
    return summary, pairs


def reuse_target(target: Path, out: Path, p: Preset):
    """--target: drafters for an already-built target (stages 1-4 skipped). The chat pairs
    are rebuilt from the same standard-library files the corpus manifest lists."""
    if not (target / "config.json").is_file():
        sys.exit(f"error: --target {target} is not a model folder (no config.json)")
    if target != (out / "target").resolve():
        shutil.rmtree(out / "target", ignore_errors=True)
        shutil.copytree(target, out / "target")
    files = stdlib_sources(p.corpus_bytes)
    pairs = training_pairs(files)
    log(f"target: reusing {target} ({len(pairs)} chat examples for the drafters' prompts)")
    return {"target_reused": str(target), "seconds": {}}, pairs
