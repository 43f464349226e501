"""The web page: `GET /` and its static assets under `/ui/` (shipped in the package, no build
step, no CDN), and `GET /admin/models`, the model picker's list (registry rows, models already on
this machine, the loaded one; read from disk only, never the network).

Assets get one fixed route each (not a catch-all mount), so the access metrics keep a bounded
set of route labels. The page and assets hold no secrets and need no API key (`ApiKey` lets
them through); every API call the page makes sends the key its user typed."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from .engine import model_id

ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

# The page talks to its own origin only and may not be framed (a framing page could trick a
# click on "Load"); model output is inserted as text, never as markup.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

DRAFTER_ARCHS = ("DSparkModel", "DraftModel", "Speculator")


def read_assets() -> dict[str, bytes]:
    """The packaged files of `outrider/server/web/`, by file name (empty if not installed)."""
    folder = files("outrider.server").joinpath("web")
    if not folder.is_dir():
        return {}
    return {
        f.name: f.read_bytes()
        for f in folder.iterdir()
        if f.is_file() and Path(f.name).suffix in ASSET_TYPES
    }


def _is_target(folder: Path) -> bool:
    """A model folder a target can load from (drafter checkpoints are not targets)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = [str(a) for a in config.get("architectures") or []]
    return not any(a.endswith(DRAFTER_ARCHS) for a in archs)


def _hf_cache_models() -> list[dict[str, Any]]:
    """Model repos in the Hugging Face cache with a snapshot holding config.json."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    out = []
    try:
        repos = sorted(p for p in root.iterdir() if p.name.startswith("models--"))
    except OSError:
        return []
    for repo in repos:
        snaps = sorted((repo / "snapshots").glob("*"), key=_mtime, reverse=True)
        snap = next((s for s in snaps if (s / "config.json").is_file()), None)
        if snap is not None and _is_target(snap):
            name = repo.name.removeprefix("models--").replace("--", "/", 1)
            out.append({"name": name, "ref": name, "source": "Hugging Face cache"})
    return out


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _folder_models() -> list[dict[str, Any]]:
    """Model folders (with config.json, as owner/name or one level down) under the model
    roots: OUTRIDER_MODEL_DIRS, mlx-dspark's, LM Studio's (`hub.model_roots`)."""
    from ..core import hub

    out, seen = [], set()
    for root, source in hub.model_roots():
        try:
            folders = sorted([*root.glob("*/*"), *root.glob("*")])
        except OSError:
            continue
        for folder in folders:
            if folder in seen or not (folder / "config.json").is_file() or not _is_target(folder):
                continue
            seen.add(folder)
            name = str(folder.relative_to(root))
            out.append({"name": name, "ref": str(folder), "source": source})
    return out


def registry_rows() -> list[dict[str, Any]]:
    """Registry rows as the picker shows them (`outrider models`' rows, read offline): whether
    the target is on disk, its size and whether the pair fits this machine (null: unknown)."""
    from ..registry.listing import model_rows

    return [
        {
            "id": row["id"],
            "ref": row["target"],
            "family": row["family"],
            "mode": row["mode"],
            "drafters": {m: d["repo"] for m, d in row["drafters"].items()},
            "drafters_local": {m: d["local"] for m, d in row["drafters"].items()},
            "speedup": row["speedup"],
            "local": row["target_local"],
            "size_gb": row["size_gb"],
            "fits": row["fits"],
        }
        for row in model_rows(online=False)
    ]


def model_list(state: Any) -> dict[str, Any]:
    """What the picker shows: the loaded model, the modes, the registry and local models."""
    pipe = state.engine.pipeline
    loaded = None
    if pipe is not None:
        loaded = {
            "model": model_id(pipe),
            "ref": pipe.target.name,
            "mode": pipe.mode,
            "drafter": pipe.drafter_ref,
            "max_draft": pipe.max_draft,
        }
    try:
        modes = sorted(state.plugins().strategies)
    except Exception:
        modes = []
    return {
        "loaded": loaded,
        "modes": ["auto", *modes],
        "registry": registry_rows(),
        "local": _folder_models() + _hf_cache_models(),
    }


def router(state: Any) -> APIRouter:
    """The page at `/`, its assets at `/ui/<file>`, and `/admin/models`."""
    r = APIRouter()
    assets = read_assets()
    page = assets.get("index.html")

    @r.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def root() -> Response:
        if page is None:  # an install without the web files still answers the probe
            return Response("outrider\n", media_type="text/plain")
        return Response(page, media_type=ASSET_TYPES[".html"], headers=PAGE_HEADERS)

    for name, body in assets.items():
        if name == "index.html":
            continue
        r.add_api_route(
            f"/ui/{name}",
            _asset(body, ASSET_TYPES[Path(name).suffix]),
            methods=["GET", "HEAD"],
            include_in_schema=False,
        )

    @r.get("/admin/models")
    def models() -> dict:
        return model_list(state)

    return r


def _asset(body: bytes, media_type: str):
    def serve() -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return serve
