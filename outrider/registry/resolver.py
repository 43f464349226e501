"""Matching a model id or path to a registry row, quantisation suffix ignored."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

QUANT_SUFFIX = re.compile(
    r"([-_.](mlx|bf16|fp16|f16|\d+bit|\d+-bit|q\d(_k_m)?|int\d|nvfp4|mxfp4|awq|gptq|dwq))+$"
)


@dataclass
class Pair:
    id: str
    target: str
    family: str
    mode: str
    drafters: dict[str, str] = field(default_factory=dict)
    cap: int | None = None
    confidence_threshold: float = 0.0
    lookup: bool = True
    speedup: str = ""
    source: str = ""


def load_pairs(path: Path | None = None) -> list[Pair]:
    text = (
        path.read_text()
        if path
        else files("outrider.registry").joinpath("targets.toml").read_text()
    )
    rows = tomllib.loads(text).get("pair", [])
    pairs = []
    for row in rows:
        drafters = {m: row[m] for m in ("dspark", "dflash", "dflash2", "eagle3") if row.get(m)}
        pairs.append(
            Pair(
                id=row["id"],
                target=row["target"],
                family=row.get("family", "dense"),
                mode=row.get("mode", "lookup"),
                drafters=drafters,
                cap=row.get("cap"),
                confidence_threshold=float(row.get("confidence_threshold", 0.0)),
                lookup=bool(row.get("lookup", True)),
                speedup=row.get("speedup", ""),
                source=row.get("source", ""),
            )
        )
    return pairs


def normalise(name: str) -> str:
    base = name.rstrip("/").split("/")[-1].lower()
    return QUANT_SUFFIX.sub("", base)


def find_pair(model: str, pairs: list[Pair] | None = None) -> Pair | None:
    """The row whose target is the model id itself, else whose id equals the model's basename
    without its quantisation suffix."""
    pairs = load_pairs() if pairs is None else pairs
    for pair in pairs:
        if model == pair.target:
            return pair
    name = normalise(model)
    for pair in sorted(pairs, key=lambda p: -len(p.id)):
        if name == pair.id or name.replace("-", "") == pair.id.replace("-", ""):
            return pair
    return None
