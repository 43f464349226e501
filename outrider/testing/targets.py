"""Tiny random-weight target folders of real architectures, and a learnable one for training."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .configs import SANDWICH_NORMS, text_config, tiny_config
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

# per model_type, the weights whose layer outputs a random tied-embedding model scales up
LOUDER_OUTPUTS = {
    "gemma4_text": SANDWICH_NORMS,
    "gemma3_text": SANDWICH_NORMS,
    "gemma2": SANDWICH_NORMS,
    "lfm2": ("out_proj.weight", "feed_forward.w2.weight"),
    "lfm2_moe": ("out_proj.weight", "down_proj.weight"),
}


def build_model(config: dict, seed: int = 0, scale: float = 4.0, dtype: mx.Dtype | None = None):
    """An mlx-lm model of the config's architecture with random weights.

    The output head is scaled up so that greedy choices are decisive (random models otherwise
    produce near-uniform logits where fp rounding could flip an argmax). With `dtype` the
    floating weights are cast before they are made, one array at a time, so a large shape
    (a 32B one: 131 GB in float32) never exists in float32 as a whole.
    """
    mx.random.seed(seed)
    if "vision_config" in config:
        model = _vlm_model(config)
    else:
        from mlx_lm.utils import _get_classes

        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    # Gemma scales its tied embedding by sqrt(hidden), and LFM2 ties its embedding too: without
    # louder layer outputs such a random model only echoes its input token.
    louder = LOUDER_OUTPUTS.get(text_config(config).get("model_type"), ())
    for name in params:
        if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
            params[name] = params[name] * scale
        elif louder and name.endswith(louder):
            params[name] = params[name] * 16.0
    _randomize_packed(params)
    if dtype is not None:
        params = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                  for k, v in params.items()}  # fmt: skip
    model.load_weights(list(params.items()))
    del params  # the model holds the only references: each float32 input dies once it is cast
    for _, value in tree_flatten(model.parameters()):
        mx.eval(value)
    return model


def _vlm_model(config: dict):
    """An mlx-vlm model (all towers) of the config's architecture."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    model_cls, _ = get_model_and_args(config=config)
    model_config = model_cls.ModelConfig.from_dict(copy.deepcopy(config))
    model_config = update_module_configs(
        model_config, model_cls, copy.deepcopy(config), ["text", "vision", "audio"]
    )
    return model_cls.Model(model_config)


def _randomize_packed(params: dict) -> None:
    """Give quantized (packed) layers random codes, scales and signs; they start as zeros."""
    for name, value in params.items():
        if value.dtype == mx.uint32 and name.endswith(".weight"):
            bits = mx.random.randint(0, 2**16, value.shape).astype(mx.uint32)
            params[name] = bits * 65537
        elif name.endswith(".scales"):
            params[name] = (0.05 + 0.05 * mx.random.uniform(shape=value.shape)).astype(value.dtype)
        elif name.endswith(".biases"):
            params[name] = mx.full(value.shape, -0.1, dtype=value.dtype)
        elif name.endswith(".signs"):
            params[name] = mx.where(mx.random.uniform(shape=value.shape) < 0.5, -1.0, 1.0)


def make_tiny_target(path: str | Path, family: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Write a tiny random-weight model folder of a real mlx-lm / mlx-vlm architecture (float32).

    `family` is the mlx-lm model_type: qwen3, llama, qwen2, qwen3_moe, qwen3_5, qwen3_5_moe,
    qwen3_next, prism_hadamard_qwen35, nemotron_h, lfm2, lfm2_moe, gemma4_text, gemma3_text,
    gemma2, muse_glimmer;
    or gemma4 and muse_glimmer_vlm for mlx-vlm multimodal checkpoints (language tower + a toy
    vision tower).
    Sliding windows are `SLIDING_WINDOW` tokens, so short generations wrap them.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    overrides.setdefault("vocab_size", vocab)
    config = tiny_config(family, **overrides)
    config["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>") + vocab - len(SPECIAL_TOKENS)
    model = build_model(config, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def cast_model(model, dtype) -> None:
    """Cast a model's floating parameters in place (benchmarks build bf16 models this way)."""
    model.update(
        tree_map(
            lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )


TOY_WORDS = ["alpha", "beta", "gamma", "delta", "sea", "sun", "code", "list", "tree", "map"]


def make_toy_training_set(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """(target folder, prompts.jsonl) for drafter-training tests: a learnable tiny target.

    A random tiny model is close to uniform and its continuations are noise no drafter can
    learn; with its attention and MLP outputs scaled down it becomes nearly a bigram model
    (still a real qwen3 with real context effects), so its own answers follow a chain a drafter
    can pick up in a few dozen steps.
    """
    root = Path(root)
    target = make_tiny_target(root / "target", seed=seed)
    weights = dict(mx.load(str(target / "model.safetensors")))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    rng = random.Random(seed)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(19):
            words = " ".join(rng.choice(TOY_WORDS) for _ in range(3))
            f.write(json.dumps({"turns": [words]}) + "\n")
    return target, prompts


def toy_train_config(target: str | Path, prompts: str | Path, out: str | Path, **overrides):
    """A TrainConfig for `make_toy_training_set`'s pair: small windows and blocks, a high
    learning rate, so a few dozen steps show learning; callers override what they exercise."""
    from ..train import TrainConfig

    settings = dict(
        model=str(target),
        data=[str(prompts)],
        out=str(out),
        steps=24,
        batch_size=8,
        seq_len=96,
        lr=1e-2,
        block_size=5,
        max_new_tokens=40,
        held_out=3,
        eval_tokens=32,
        seed=0,
    )
    return TrainConfig(**{**settings, **overrides})
