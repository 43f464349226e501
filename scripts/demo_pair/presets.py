"""The recipe's sizes and settings: `tiny` for tests on a CPU, `demo` for the shipped pair."""

from __future__ import annotations

from dataclasses import dataclass

SIZE_LIMIT_MB = 16.0


@dataclass(frozen=True)
class Preset:
    corpus_bytes: int  # 0: the whole standard library
    vocab_size: int  # including the special tokens
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    bits: int  # target quantisation
    dtype: str  # the saved target's float dtype (scales, norms)
    minutes: float  # the target's training stops here even if steps remain
    drafter_steps: int
    drafter_batch: int
    drafter_seq_len: int
    drafter_lr: float
    drafter_warmup: int
    drafter_layers: int
    block_size: int
    prompts: int  # self-distillation prompts for the drafters
    max_new_tokens: int
    held_out: int


PRESETS = {
    "tiny": Preset(
        corpus_bytes=250_000,
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        seq_len=96,
        batch_size=4,
        steps=40,
        lr=3e-3,
        warmup=6,
        bits=8,
        dtype="float32",
        minutes=2.0,
        drafter_steps=20,
        drafter_batch=4,
        drafter_seq_len=96,
        drafter_lr=3e-3,
        drafter_warmup=2,
        drafter_layers=1,
        block_size=4,
        prompts=8,
        max_new_tokens=32,
        held_out=2,
    ),
    "demo": Preset(
        corpus_bytes=0,
        vocab_size=4096,
        hidden_size=256,
        num_layers=8,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seq_len=512,
        batch_size=32,
        steps=2000,
        lr=2e-3,
        warmup=100,
        bits=8,
        dtype="float32",  # float16 runs ~30x slower on MLX's CPU backend (fresh CPU installs)
        minutes=5.0,
        drafter_steps=4000,
        drafter_batch=16,
        drafter_seq_len=512,
        drafter_lr=6e-4,
        drafter_warmup=100,
        drafter_layers=1,
        block_size=8,
        prompts=4096,
        max_new_tokens=256,
        held_out=16,
    ),
}


def log(message: str) -> None:
    print(f"[make_demo_pair] {message}", flush=True)
