"""The prompt suites shipped with the package (first 10 rows of each public set, first turn)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

from ..core.errors import OutriderError

# suite -> the prompt files it draws from, in the order they are interleaved
SUITES: dict[str, tuple[str, ...]] = {
    "chat": ("mt-bench",),
    "code": ("humaneval", "mbpp"),
    "math": ("gsm8k", "math500"),
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
