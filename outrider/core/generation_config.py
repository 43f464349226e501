"""The sampling a model's publisher recommends, for requests that leave theirs unset.

Hugging Face checkpoints carry it in `generation_config.json` (`do_sample`, `temperature`,
`top_p`, `top_k`); a GGUF file in its `general.sampling.*` keys (llama.cpp's gguf-py names:
`general.sampling.temp`, `.top_p`, `.top_k`). Many repositories ship neither, and then an unset
temperature means greedy decoding. Thinking models in particular are published with a sampling
recommendation because greedy decoding sends them into repetition loops.

The server resolves each field on its own: the request's value, else the `serve` flag
(`--default-temperature`, `--default-top-p`, `--default-top-k`), else the model's, else greedy
(temperature 0, top-p 1, top-k 0). `outrider generate` keeps its own flags' defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gguf_header

FIELDS = ("temperature", "top_p", "top_k")
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling fields to use where a request sets none (None: no opinion)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    source: str = ""  # where they came from, for notes and /health

    def over(self, other: SamplingDefaults) -> SamplingDefaults:
        """These fields, and `other`'s where these have none."""
        merged = {k: _first(getattr(self, k), getattr(other, k)) for k in FIELDS}
        used = [part.source for part in (self, other) if part.source and part.set()]
        return SamplingDefaults(**merged, source=" over ".join(used))

    def set(self) -> bool:
        return bool(self.as_dict())

    def describe(self) -> str:
        """`temperature 0.6, top_p 0.95, top_k 20` (the fields set)."""
        return ", ".join(f"{k} {v:g}" for k, v in self.as_dict().items())

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in FIELDS if getattr(self, k) is not None}


GREEDY = SamplingDefaults(0.0, 1.0, 0)  # what no one's word leaves: plain greedy decoding


def _first(a: Any, b: Any) -> Any:
    return a if a is not None else b


def check(
    temperature: Any, top_p: Any, top_k: Any, source: str, label: str = "{source}: {name}"
) -> tuple[SamplingDefaults, list[str]]:
    """The values that are in range, and one note for each that is not (left out), naming the
    value as `label` says."""
    notes, kept = [], {}
    for name, value, ok, rule in (
        ("temperature", temperature, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", top_k, lambda v: v >= 0 and float(v).is_integer(), "a whole number >= 0"),
    ):
        if value is None:
            continue
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number) or not ok(number):
            where = label.format(source=source, name=name, flag=name.replace("_", "-"))
            notes.append(f"{where} {value!r} is not {rule}")
            continue
        kept[name] = int(number) if name == "top_k" else float(number)
    return SamplingDefaults(**kept, source=source if kept else ""), notes


def read(path: Path) -> tuple[SamplingDefaults, list[str]]:
    """A model's recommended sampling (folder or GGUF file) and notes on what was ignored."""
    if gguf_header.is_gguf(path):
        meta = gguf_header.read_header(path).metadata
        values = {k: meta.get(key) for k, key in GGUF_KEYS.items()}
        return _ignored(check(**values, source=path.name, label="{source}: sampling {name}"))
    file = path / "generation_config.json"
    if not file.is_file():
        return SamplingDefaults(), []
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return SamplingDefaults(), [f"generation_config.json is unreadable ({e}); ignored"]
    if not isinstance(cfg, dict):
        return SamplingDefaults(), ["generation_config.json is not a JSON object; ignored"]
    if not cfg.get("do_sample"):  # Transformers decodes greedily without it, whatever else
        return SamplingDefaults(), []
    values = {k: cfg.get(k) for k in ("temperature", "top_p", "top_k")}
    if values["temperature"] is None:  # Transformers samples at its default temperature, 1
        values["temperature"] = 1.0
    return _ignored(check(**values, source="generation_config.json"))


def _ignored(
    checked: tuple[SamplingDefaults, list[str]],
) -> tuple[SamplingDefaults, list[str]]:
    defaults, notes = checked
    return defaults, [f"{n}; ignored" for n in notes]
