"""The prefix cache's disk tier: entries as safetensors files with a JSON sidecar each, in one
folder bounded in size (least recently used deleted first), read back after a restart.

A file made for another model or outrider version, laid out in another format, or not matching
its checksum or its own token record is refused and deleted, never loaded: the next request
rebuilds it. A disk that cannot be written turns the tier off with a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from .family import LayerSnapshot
from .prefix_entry import Entry, entry_key, shared_prefix

# Files of another format are never read (their requests miss and rewrite them). 2: entries
# keep logits rows (`logits.<n>`), listed in the layout and sidecar.
FORMAT = 2


def outrider_version() -> str:
    from .. import __version__

    return __version__


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class DiskTier:
    """One folder of entries for one model (`identity`), at most `max_bytes` of files.
    `stats` is the store's: the tier counts `disk_writes` and `disk_refused` into it."""

    def __init__(self, directory: Path, max_bytes: int, stats: dict[str, int]) -> None:
        self.directory: Path | None = directory
        self.max_bytes = max_bytes
        self.stats = stats
        self.identity = ""
        self.index: dict[str, tuple[np.ndarray, set[int]]] = {}  # stem -> tokens, prompt ends

    @property
    def on(self) -> bool:
        return self.directory is not None

    def scan(self, identity: str) -> None:
        """Read the sidecars of `identity`'s files; a file of an older format is deleted."""
        self.identity, self.index = identity, {}
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            sidecars = list(self.directory.glob("*.json"))
        except OSError as e:
            self._off(e)
            return
        for side in sidecars:
            try:
                meta = json.loads(side.read_text())
                if meta.get("identity") != identity or meta.get("version") != outrider_version():
                    continue
                if meta.get("format") != FORMAT:  # ours, but laid out otherwise: never read
                    self.stats["disk_refused"] += 1
                    self.delete(side.stem)
                    continue
                tokens = np.asarray(meta["tokens"], dtype=np.int64)
                self.index[side.stem] = (tokens, {int(p) for p in meta["ends"]})
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable sidecars are refused when their file is asked for

    def best(self, ids: np.ndarray) -> tuple[str, int] | None:
        """The file holding the longest usable prefix of `ids` (by its sidecar), and how long."""
        whole = len(ids)
        best = None
        for stem, (tokens, ends) in self.index.items():
            shared = shared_prefix(tokens, ids)
            n = whole if shared == whole and whole in ends else min(shared, whole - 1)
            if n > 0 and (best is None or n > best[1]):
                best = (stem, n)
        return best

    def delete(self, stem: str) -> None:
        if self.directory is None:
            return
        self.index.pop(stem, None)
        for suffix in (".safetensors", ".json"):
            try:
                (self.directory / (stem + suffix)).unlink(missing_ok=True)
            except OSError:
                pass

    def forget(self, tokens: np.ndarray) -> None:
        """Delete the file of the sequence `tokens` (an entry a longer one absorbed)."""
        self.delete(entry_key(self.identity, tokens))

    def write(self, entry: Entry) -> None:
        """Write `entry` (its file, then its sidecar), then keep the folder within bounds."""
        if self.directory is None:
            return
        stem = entry_key(self.identity, entry.tokens)
        arrays: dict[str, mx.array] = {"tokens": mx.array(entry.tokens.astype(np.int32))}
        if entry.taps is not None:
            arrays["taps"] = entry.taps
        for p, row in entry.logits.items():
            arrays[f"logits.{p}"] = row

        def layout(snaps: list[LayerSnapshot | None], prefix: str) -> list:
            out = []
            for i, s in enumerate(snaps):
                if s is None:
                    out.append(None)
                    continue
                for j, a in enumerate(s.arrays):
                    if a is not None:
                        arrays[f"{prefix}.{i}.{j}"] = a
                present = [a is not None for a in s.arrays]
                out.append([s.kind, s.meta, s.trimmable, present])
            return out

        plan = {
            "final": layout(entry.final, "final"),
            "checkpoints": {str(p): layout(ck, f"ck{p}") for p, ck in entry.checkpoints.items()},
            "tap_ids": list(entry.tap_ids),
            "logits": sorted(entry.logits),
            "marks": sorted(entry.marks),  # read with .get: files without it have none
        }
        metadata = {
            "identity": self.identity,
            "version": outrider_version(),
            "format": str(FORMAT),
            "tokens_sha": entry_key("", entry.tokens),
            "layout": json.dumps(plan),
        }
        path = self.directory / f"{stem}.safetensors"
        tmp = self.directory / f".{stem}.tmp.safetensors"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata)
            digest = file_sha(tmp)
            os.replace(tmp, path)
            side = {
                "identity": self.identity,
                "version": outrider_version(),
                "format": FORMAT,
                "sha256": digest,
                "tokens": entry.tokens.tolist(),
                "ends": sorted(entry.logits),
            }
            (self.directory / f"{stem}.json").write_text(json.dumps(side))
        except (OSError, RuntimeError, ValueError) as e:  # full or read-only disk
            for p in (tmp, path):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            self._off(e)
            return
        self.index[stem] = (entry.tokens, set(entry.logits))
        self.stats["disk_writes"] += 1
        self._bound(keep=stem)

    def load(self, stem: str) -> Entry | None:
        """One file's entry; a damaged or foreign file is refused (a warning) and deleted."""
        path = self.directory / f"{stem}.safetensors"
        try:
            side = json.loads((self.directory / f"{stem}.json").read_text())
            if side.get("sha256") != file_sha(path):
                raise ValueError("checksum mismatch (damaged file)")
            arrays, metadata = mx.load(str(path), return_metadata=True)
            if (
                metadata.get("identity") != self.identity
                or metadata.get("version") != outrider_version()
            ):
                raise ValueError("made for another model or outrider version")
            if metadata.get("format") != str(FORMAT):
                raise ValueError(f"file format {metadata.get('format', 1)}, not {FORMAT}")
            tokens = np.asarray(arrays["tokens"], dtype=np.int64)
            if metadata.get("tokens_sha") != entry_key("", tokens):
                raise ValueError("token ids do not match the file's own record")
            plan = json.loads(metadata["layout"])
            logits = {int(p): arrays[f"logits.{p}"] for p in plan["logits"]}
            widths = {(row.ndim, row.shape[-1]) for row in logits.values()}
            if len(widths) > 1 or any(w[0] != 1 for w in widths):
                raise ValueError("logits rows of different shapes")
            if any(not 0 < p <= len(tokens) for p in logits):
                raise ValueError("a logits row past the file's tokens")

            def build(items: list, prefix: str) -> list:
                out = []
                for i, item in enumerate(items):
                    if item is None:
                        out.append(None)
                        continue
                    kind, meta, trimmable, present = item
                    layer = [
                        arrays[f"{prefix}.{i}.{j}"] if p else None for j, p in enumerate(present)
                    ]
                    out.append(LayerSnapshot(kind, layer, dict(meta), bool(trimmable)))
                return out

            entry = Entry(
                tokens,
                build(plan["final"], "final"),
                {int(p): build(ck, f"ck{p}") for p, ck in plan["checkpoints"].items()},
                arrays.get("taps"),
                tuple(plan["tap_ids"]),
                logits,
            )
            entry.marks = {int(p) for p in plan.get("marks", [])} & set(entry.checkpoints)
            os.utime(path)  # recently used: last to be deleted
        except Exception as e:  # noqa: BLE001 - anything wrong with a file means: refuse it
            warnings.warn(f"prefix cache refused {path.name}: {e}", stacklevel=4)
            self.stats["disk_refused"] += 1
            self.delete(stem)
            return None
        return entry

    def _bound(self, keep: str) -> None:
        """Delete the least recently used files until the folder fits its size bound."""
        try:
            files = sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
            total = sum(p.stat().st_size for p in files)
        except OSError:
            return
        for p in files:
            if total <= self.max_bytes:
                break
            if p.stem == keep:
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            self.delete(p.stem)
            total -= size

    def _off(self, e: BaseException) -> None:
        warnings.warn(f"prefix cache disk tier off: {e}", stacklevel=4)
        self.directory = None
        self.index = {}
