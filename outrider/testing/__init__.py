"""Tiny real-architecture models for tests (ours and plugin authors').

`make_tiny_target` writes a Hugging Face style folder (config.json, safetensors, a byte-level
tokenizer with a chat template, all built offline) of a real mlx-lm architecture at toy size in
float32, with random weights. `make_tiny_drafter` writes a random-weight drafter for such a
target laid out exactly like the published checkpoints. `OracleProposer` drafts the known
answer with a chosen per-token acceptance rate.

One module per job: `configs` (toy configs per model_type), `tokenizer`, `targets` (random and
learnable targets), `gguf` (a tiny target written as llama.cpp's converter writes one),
`drafters`, `proposers`, `scripted` (a target whose answers are a script, for the server's
tool-call and reasoning tests), `cuda_compile` (a CUDA kernel body compiled with nvcc, without
a GPU: its errors, registers and spills).
"""

from .configs import FAMILIES, SLIDING_WINDOW, text_config, tiny_config
from .drafters import default_tap_ids, make_tiny_drafter
from .gguf import make_tiny_gguf
from .proposers import OracleProposer
from .scripted import SCRIPT, make_scripted_target
from .targets import (
    build_model,
    cast_model,
    make_tiny_target,
    make_toy_training_set,
    toy_train_config,
)
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer, chat_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SCRIPT",
    "SLIDING_WINDOW",
    "SPECIAL_TOKENS",
    "OracleProposer",
    "build_model",
    "build_tokenizer",
    "cast_model",
    "chat_tokenizer",
    "default_tap_ids",
    "make_scripted_target",
    "make_tiny_drafter",
    "make_tiny_gguf",
    "make_tiny_target",
    "make_toy_training_set",
    "text_config",
    "tiny_config",
    "toy_train_config",
]
