"""Stage 1: the corpus (the Python standard library's own sources) and its chat examples."""

from __future__ import annotations

import ast
import json
import platform
import random
import shutil
import sysconfig
import textwrap
from pathlib import Path

from .tokenizer import ChatFormat

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_sources(limit: int) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files, sorted, tests left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        try:
            files.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if limit:
        kept, total = [], 0
        for rel, text in files:
            if total >= limit:
                break
            kept.append((rel, text))
            total += len(text)
        files = kept
    return files


def functions(source: str, lo: int = 60, hi: int = 2000) -> list[tuple[str, str]]:
    """(prompt `def name(`, whole function) for each function of a module of sane length."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines, out = source.splitlines(keepends=True), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            if lo <= len(text) <= hi:
                body = textwrap.dedent(text)
                head = body[: body.find("(") + 1]
                if head.lstrip().startswith(("def ", "async def ")):
                    out.append((head, body))
    return out


def write_corpus(work: Path, files: list[tuple[str, str]]) -> dict:
    """corpus/ holds the licence and a manifest, so the provenance travels with the data."""
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if licence.is_file():
        shutil.copy(licence, corpus / "LICENSE-PSF.txt")
    manifest = {
        "source": "Python standard library .py sources (sysconfig stdlib path; tests excluded)",
        "licence": "PSF-2.0 (Python Software Foundation License Version 2)",
        "python": platform.python_version(),
        "files": len(files),
        "bytes": sum(len(t) for _, t in files),
    }
    (corpus / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def held_out(index: int) -> bool:
    """Every 20th file is validation text: never trained on, never a drafter prompt."""
    return index % 20 == 0


def training_pairs(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The chat pairs of the training files, as `documents` returns them."""
    return [
        pair for i, (_, text) in enumerate(files) if not held_out(i) for pair in functions(text)
    ]


def documents(files, tokenizer, seed: int) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Train and validation texts (every 20th file held out) and the training chat pairs."""
    rng, chat = random.Random(seed), ChatFormat(tokenizer)
    train, valid, pairs = [], [], []
    for i, (_, text) in enumerate(files):
        docs = [text + "<|endoftext|>"]
        fns = functions(text)
        docs += [chat(p, a, rng.random() < 0.25) for p, a in fns]
        (valid if held_out(i) else train).extend(docs)
        if not held_out(i):
            pairs.extend(fns)
    rng.shuffle(train)
    return train, valid, pairs


def pack(texts: list[str], tokenizer, seq_len: int) -> list[tuple[list[int], int]]:
    """One token stream cut into seq_len+1 windows, in mlx-lm's (tokens, offset) item form."""
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
    n = seq_len + 1
    return [(stream[i : i + n], 0) for i in range(0, len(stream) - n + 1, n)]
