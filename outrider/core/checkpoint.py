"""Reading a checkpoint folder safely: config.json plus safetensors, nothing executable."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .errors import CheckpointError
from .quantized import dequantize_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Checkpoint:
    path: Path
    config: dict
    _tensors: dict[str, mx.array] | None = None

    @property
    def tensors(self) -> dict[str, mx.array]:
        if self._tensors is None:
            self._tensors = dequantize_tensors(read_safetensors(self.path), self.config)
        return self._tensors


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg} does not hold a JSON object")
    return data


def code_it_runs(config: dict) -> str | None:
    """Why loading this config would run the checkpoint's own Python, else None: mlx-lm builds
    the architecture from a file the folder ships where config.json names a `model_file`
    (it asks for trust_remote_code first, which outrider never passes). outrider refuses such
    a checkpoint in its own words, before anything is loaded or released."""
    name = config.get("model_file")
    if name is None:
        return None
    return (
        f"it asks to build its architecture with its own Python code (model_file {str(name)!r}"
        " in config.json), and outrider never runs code from a checkpoint; use a model whose"
        " model_type mlx-lm knows"
    )


def read_safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise CheckpointError(
                f"{path} holds only pickle-based weights ({', '.join(pickled)}); outrider never "
                "unpickles checkpoint files (that can run code): convert them to safetensors"
            )
        raise CheckpointError(f"{path} has no .safetensors weight files")
    tensors: dict[str, mx.array] = {}
    for f in files:
        try:
            part = mx.load(str(f), format="safetensors")
        except Exception as e:  # mlx raises RuntimeError/ValueError on damaged files
            raise CheckpointError(f"{f.name} is not a readable safetensors file ({e})") from None
        tensors.update(part)
    return tensors


def open_checkpoint(path: Path) -> Checkpoint:
    if not path.is_dir():
        raise CheckpointError(f"drafter checkpoint {path} is not a folder")
    return Checkpoint(path, read_config(path))
