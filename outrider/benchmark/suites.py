"""The prompt suites shipped with the package (first 10 rows of each public set, first turn),
and a user's own prompt files (JSON lines with `turns` or `prompt`), each its own suite."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ..core.errors import OutriderError

# suite -> the prompt files it draws from, in the order they are interleaved
SUITES: dict[str, tuple[str, ...]] = {
    "chat": ("mt-bench",),
    "code": ("humaneval", "mbpp"),
    "math": ("gsm8k", "math500"),
    "copy": ("copy",),  # rewrite a file with one change: lookup's long drafts (written here)
}


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    source: str  # the prompt file it came from
    index: int  # its row in that file
    text: str  # the first user turn


def read_prompt_file(name: str) -> list[str]:
    """First turns of one shipped prompt file."""
    text = (
        files("outrider.benchmark").joinpath("prompts").joinpath(f"{name}.jsonl").read_text("utf-8")
    )
    return [json.loads(line)["turns"][0] for line in text.splitlines() if line.strip()]


def parse_suites(spec: str) -> list[str]:
    """'chat,code' -> ['chat', 'code'], refusing names that are not suites."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES]
    if unknown or not names:
        raise OutriderError(
            f"unknown suite {', '.join(unknown) or repr(spec)}; choose from {', '.join(SUITES)}"
        )
    return list(dict.fromkeys(names))


def load_suite(suite: str, limit: int | None = None) -> list[BenchPrompt]:
    """The suite's prompts, taking from its files in turn (code: humaneval 0, mbpp 0, ...)."""
    if suite not in SUITES:
        raise OutriderError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    per_file = [(name, read_prompt_file(name)) for name in SUITES[suite]]
    prompts: list[BenchPrompt] = []
    for i in range(max(len(rows) for _, rows in per_file)):
        for name, rows in per_file:
            if i < len(rows):
                prompts.append(BenchPrompt(suite, name, i, rows[i]))
    return prompts if limit is None else prompts[:limit]


def read_user_prompts(path: str | Path, limit: int | None = None) -> list[BenchPrompt]:
    """A user's prompt file as one suite named after the file: JSON lines, each an object with
    `turns` (the first is used) or `prompt`."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise OutriderError(f"--prompts {path}: cannot read it ({e})") from None
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise OutriderError(f"--prompts {path}, line {number}: not JSON ({e})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        text = turns[0] if isinstance(turns, list) and turns else None
        if text is None and isinstance(row, dict):
            text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise OutriderError(
                f"--prompts {path}, line {number}: a row needs a non-empty `prompt` string or "
                "`turns` list of strings"
            )
        prompts.append(BenchPrompt(path.stem, path.name, len(prompts), text))
    if not prompts:
        raise OutriderError(f"--prompts {path}: no prompts in the file")
    return prompts if limit is None else prompts[:limit]
