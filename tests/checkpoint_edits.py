"""Copies of checkpoint folders with their config or tensors changed: how the format tests
make a damaged, mislabelled or edited drafter from a good one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn: Callable[[dict], None]) -> None:
    f = path / "model.safetensors"
    tensors = dict(mx.load(str(f)))
    fn(tensors)
    mx.save_safetensors(str(f), tensors)


def edited(src: Path, dst: Path, change: Callable[[dict], None]) -> str:
    """A copy of `src` whose config `change` rewrote in place (nested fields too)."""
    copy_ckpt(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)
