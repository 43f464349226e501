"""What `outrider registry check` checks: the registry TOML and every receipt it cites.

Each problem is one line naming the row (or receipt) and what is wrong, so a contributor can fix
a pull request from the CI log alone.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from .resolver import DRAFTER_MODES, normalise, quant_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODES = (*DRAFTER_MODES, "lookup", "baseline")
REQUIRED = ("id", "target", "family", "mode")
# keys a row may carry besides the drafter entries (unknown keys are usually typos)
ROW_KEYS = {
    *REQUIRED,
    "aliases",
    "cap",
    "confidence_threshold",
    "drafter_window",
    "lookup",
    "speedup",
    "source",
    "receipt",
    "quant",
    "package",
    "package_file",
    "install",
    "size_gb",
    *DRAFTER_MODES,
}
QUANT_KEYS = {
    "mode", "cap", "confidence_threshold", "drafter_window", "lookup", "speedup", "receipt",
    *DRAFTER_MODES,
}  # fmt: skip


@lru_cache(maxsize=1)
def receipt_schema() -> dict:
    """The receipt's JSON Schema (draft 2020-12), shipped with the package."""
    return json.loads(files("outrider.registry").joinpath("receipt.schema.json").read_text())


def claimed_architectures(plugins: Any) -> dict[str, str]:
    """`architectures` value -> the installed format plugin that claims it."""
    claims: dict[str, str] = {}
    for name, fmt in plugins.formats.items():
        for arch in getattr(fmt, "architectures", ()) or ():
            claims.setdefault(arch, name)
    return claims


def receipt_problems(receipt: Any, where: str) -> list[str]:
    """Schema, device stamp and lossless tally of one receipt (already parsed JSON)."""
    from jsonschema import Draft202012Validator

    if not isinstance(receipt, dict):
        return [f"{where}: not a JSON object"]
    problems = []
    device = receipt.get("device")
    if not isinstance(device, dict) or not device.get("chip") or not device.get("backend"):
        problems.append(f"{where}: no device stamp (device.chip and device.backend)")
    validator = Draft202012Validator(receipt_schema())
    for error in sorted(validator.iter_errors(receipt), key=lambda e: list(e.absolute_path)):
        if error.absolute_path and error.absolute_path[0] == "device" and problems:
            continue  # already named as a missing device stamp
        if not error.absolute_path and "'device'" in error.message and problems:
            continue
        at = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        problems.append(f"{where}: schema: {at}: {error.message}")
    tally = receipt.get("lossless")
    if isinstance(tally, dict):
        runs, same, ties = tally.get("runs_checked"), tally.get("identical"), tally.get("fp_ties")
        if isinstance(runs, int) and isinstance(same, int) and isinstance(ties, list):
            if same + len(ties) != runs:
                problems.append(
                    f"{where}: lossless count {same} identical + {len(ties)} fp ties "
                    f"!= {runs} runs checked"
                )
    return problems


def read_receipt(path: Path) -> tuple[Any, list[str]]:
    if not path.is_file():
        return None, [f"{path.name}: receipt not found in {path.parent}"]
    try:
        return json.loads(path.read_text()), []
    except (ValueError, OSError) as e:
        return None, [f"{path.name}: not valid JSON ({e})"]


def _drafter_problems(label: str, mode: str, value: Any, claims: dict[str, str]) -> list[str]:
    if not isinstance(value, dict):
        return [
            f"{label}: {mode} drafter {value!r} names no architecture; write "
            f'{mode} = {{ repo = "...", architecture = "..." }}'
        ]
    problems = []
    repo, arch = value.get("repo"), value.get("architecture")
    if not isinstance(repo, str) or not repo:
        problems.append(f"{label}: {mode} drafter has no repo")
    extra = set(value) - {"repo", "architecture"}
    if extra:
        problems.append(f"{label}: {mode} drafter has unknown keys {sorted(extra)}")
    if not isinstance(arch, str) or not arch:
        problems.append(f"{label}: {mode} drafter {repo} names no architecture")
    elif arch not in claims:
        problems.append(
            f"{label}: {mode} drafter {repo} has architecture {arch!r}, which no installed "
            f"format claims (claimed: {', '.join(sorted(claims)) or 'none'})"
        )
    return problems


def _settings_problems(label: str, row: dict, plugins: Any, claims: dict[str, str]) -> list[str]:
    """Mode, cap and drafters of a row or of one of its `[pair.quant.<tag>]` tables."""
    problems = []
    # a row runs a drafter it names, or lookup / baseline; `draft` needs --draft-model
    known = set(MODES) | {
        n for n, s in plugins.strategies.items() if getattr(s, "needs_drafter", False)
    }
    mode = row.get("mode")
    if mode is not None and mode not in known:
        problems.append(f"{label}: unknown mode {mode!r} (known: {', '.join(sorted(known))})")
    cap = row.get("cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        problems.append(f"{label}: cap must be an integer >= 0, got {cap!r}")
    window = row.get("drafter_window")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 0
    ):
        problems.append(f"{label}: drafter_window must be an integer >= 0, got {window!r}")
    for m in DRAFTER_MODES:
        if m in row:
            problems += _drafter_problems(label, m, row[m], claims)
    return problems


def _cited_receipt_problems(
    label: str, row: dict, folder: Path, drafters: dict[str, Any], plugins: Any
) -> list[str]:
    """The receipt a row (or quant table) cites: valid, and measured at the row's settings."""
    name = row["receipt"]
    receipt, problems = read_receipt(folder / name)
    if receipt is None:
        return [f"{label}: {problems[0]}"]
    problems = [f"{label}: {p}" for p in receipt_problems(receipt, name)]
    settings = receipt.get("settings") if isinstance(receipt, dict) else None
    if not isinstance(settings, dict):
        return problems
    mode, cap = row.get("mode"), row.get("cap")
    modes, caps = settings.get("modes") or [], settings.get("caps") or {}
    if mode not in modes:
        problems.append(f"{label}: mode {mode!r} was not measured in {name} (modes {modes})")
    elif cap is None:
        default = getattr(plugins.strategies.get(mode), "default_cap", None)
        if caps.get(mode) != default:
            problems.append(
                f"{label}: cap {default} ({mode}'s default; the row sets none) differs from "
                f"{name}'s {mode} cap {caps.get(mode)}"
            )
    elif caps.get(mode) != cap:
        problems.append(f"{label}: cap {cap} differs from {name}'s {mode} cap {caps.get(mode)}")
    repo = (drafters.get(mode) or {}).get("repo") if isinstance(drafters.get(mode), dict) else None
    arms = receipt.get("arms") if isinstance(receipt.get("arms"), list) else []
    measured = {a.get("mode"): a.get("drafter") for a in arms if isinstance(a, dict)}
    if repo and measured.get(mode) and measured[mode] != repo:
        problems.append(
            f"{label}: {name} measured {mode} with drafter {measured[mode]}, not {repo}"
        )
    return problems


def row_problems(
    index: int, row: Any, plugins: Any, claims: dict[str, str], folder: Path
) -> list[str]:
    if not isinstance(row, dict):
        return [f"row {index}: not a table"]
    label = f"row {index} ({row.get('id', '?')})"
    problems = [f"{label}: missing required key {k!r}" for k in REQUIRED if k not in row]
    for key in REQUIRED:
        if key in row and (not isinstance(row[key], str) or not row[key]):
            problems.append(f"{label}: {key} must be a non-empty string")
    unknown = sorted(set(row) - ROW_KEYS)
    if unknown:
        problems.append(f"{label}: unknown keys {unknown}")
    rid = row.get("id")
    if isinstance(rid, str) and rid and (rid != rid.lower() or normalise(rid) != rid):
        problems.append(f"{label}: id must be lowercase with no quantisation suffix")
    family = row.get("family")
    if isinstance(family, str) and family not in plugins.families:
        problems.append(
            f"{label}: unknown family {family!r} (installed: {', '.join(sorted(plugins.families))})"
        )
    problems += _settings_problems(label, row, plugins, claims)
    mode = row.get("mode")
    if mode in DRAFTER_MODES and mode not in row:
        problems.append(f"{label}: mode {mode} names no {mode} drafter")
    if row.get("receipt"):
        problems += _cited_receipt_problems(label, row, folder, row, plugins)
    quants = row.get("quant", {})
    if not isinstance(quants, dict):
        return problems + [f"{label}: quant must be a table of [pair.quant.<tag>] tables"]
    for tag, over in quants.items():
        qlabel = f"{label} [quant.{tag}]"
        if quant_of(f"x-{tag}") is None:
            problems.append(f"{qlabel}: {tag!r} is not a quantisation tag (e.g. 4bit, bf16)")
        if not isinstance(over, dict):
            problems.append(f"{qlabel}: not a table")
            continue
        bad = sorted(set(over) - QUANT_KEYS)
        if bad:
            problems.append(f"{qlabel}: unknown keys {bad}")
        problems += _settings_problems(qlabel, over, plugins, claims)
        merged = {**row, **over}
        if merged.get("mode") in DRAFTER_MODES and merged["mode"] not in merged:
            problems.append(f"{qlabel}: mode {merged['mode']} names no {merged['mode']} drafter")
        if over.get("receipt") or (row.get("receipt") and ("cap" in over or "mode" in over)):
            problems += _cited_receipt_problems(qlabel, merged, folder, merged, plugins)
    return problems


def registry_problems(
    text: str, plugins: Any, folder: Path, all_receipts: bool = True
) -> tuple[list[str], int]:
    """(problems, number of rows) for a registry TOML whose receipts live in `folder`; with
    `all_receipts`, every receipt in the folder is validated too, cited or not."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [f"not valid TOML: {e}"], 0
    problems = [
        f"unknown top-level key {k!r} (rows are [[pair]] tables)" for k in data if k != "pair"
    ]
    rows = data.get("pair", [])
    if not isinstance(rows, list):
        return problems + ["`pair` must be an array of tables ([[pair]])"], 0
    claims = claimed_architectures(plugins)
    seen: dict[str, str] = {}
    for i, row in enumerate(rows, 1):
        problems += row_problems(i, row, plugins, claims, folder)
        if not isinstance(row, dict):
            continue
        names = [row.get("id")] + [
            normalise(a) for a in row.get("aliases", []) if isinstance(a, str)
        ]
        for name in filter(None, names):
            if name in seen:
                problems.append(
                    f"row {i} ({row.get('id')}): name {name!r} is already row {seen[name]}'s"
                )
            seen.setdefault(name, f"{i} ({row.get('id')})")
    cited = {r.get("receipt") for r in rows if isinstance(r, dict)}
    cited |= {
        q.get("receipt")
        for r in rows
        if isinstance(r, dict) and isinstance(r.get("quant"), dict)
        for q in r["quant"].values()
        if isinstance(q, dict)
    }
    if all_receipts and folder.is_dir():
        for path in sorted(p for p in folder.glob("*.json") if p.name not in cited):
            receipt, bad = read_receipt(path)
            problems += bad if receipt is None else receipt_problems(receipt, path.name)
    return list(dict.fromkeys(problems)), len(rows)
