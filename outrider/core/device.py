"""Which backend MLX computes on: some kernel choices and precisions depend on it."""

from __future__ import annotations

import os

import mlx.core as mx

from .errors import OutriderError


def on_cuda_gpu() -> bool:
    """True when MLX's default device is a GPU driven by the CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


ATTENTION_ENV = "OUTRIDER_ATTENTION"


def attention_choice() -> str:
    """OUTRIDER_ATTENTION: auto (the default), split or native."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower()
    if choice not in ("auto", "split", "native"):
        raise OutriderError(f"{ATTENTION_ENV} must be auto, split or native, got {choice!r}")
    return choice


def split_attention() -> bool:
    """Whether verify and draft attention are split to fit MLX's fused one-query kernel.

    That kernel takes fewer than 4 query rows on MLX's CUDA backend (up to 8 on Metal, and the
    CPU runs every width as the same unfused ops), so `auto` splits on CUDA only; `split` and
    `native` force the choice. What `auto` leaves alone in half precision: see
    plugins/targets/verify_attention.py.
    """
    choice = attention_choice()
    return choice == "split" or (choice == "auto" and on_cuda_gpu())
