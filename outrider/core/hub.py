"""Finding model files: a local folder, LM Studio's model folders, or the Hugging Face cache."""

from __future__ import annotations

import os
from pathlib import Path

from ..demo import demo_folder, is_demo, pair_dir
from .errors import ModelNotFoundError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a repo if it is in the Hugging Face cache (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(repo_id, local_files_only=True, allow_patterns=DOWNLOAD_PATTERNS)
        )
    except Exception:
        return None


def local_model(repo_id: str) -> Path | None:
    """A repo already on this machine: LM Studio's folders first, then the HF cache; never the
    network."""
    if is_demo(repo_id):
        folder = pair_dir() / repo_id.split("/", 1)[1]
        return folder if (folder / "config.json").is_file() else None
    for root in lmstudio_roots():
        candidate = root / repo_id
        if (candidate / "config.json").is_file():
            return candidate
    local = cached_snapshot(repo_id)
    if local is not None and (local / "config.json").is_file():
        return local
    return None


def resolve_model(spec: str, what: str = "model", download: bool = True) -> Path:
    """A local folder for `spec` (path or repo id), downloading through the HF cache if allowed."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{what} path {spec} is a file; pass the model's folder")
        return path
    if not looks_like_repo_id(spec):
        raise ModelNotFoundError(f"{what} {spec!r}: no such folder, and not a Hugging Face repo id")
    if is_demo(spec):  # the embedded demo pair: package data, never the hub
        return demo_folder(spec)
    local = local_model(spec)
    if local is not None:
        return local
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline or not download:
        raise ModelNotFoundError(
            f"{what} {spec} is not in the Hugging Face cache and downloads are off; run "
            f"`huggingface-cli download {spec}` on a connected machine, or pass a local folder"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:
        reason = type(e).__name__
        raise ModelNotFoundError(
            f"{what} {spec} is not in the Hugging Face cache and could not be downloaded "
            f"({reason}); check the repo id and your network, or pass a local folder"
        ) from None
