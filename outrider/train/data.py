"""Training data: prompt/text files in, fixed-length token windows with loss masks out.

A record is a chat (`{"turns": [...]}`) or a document (`{"text": ...}`, or a plain text/code
file). Chats are answered by the target itself first (self-distillation, as DeepSpec regenerates
its answers), so the drafter learns what *this* target writes; only the answers are supervised.
Documents are supervised everywhere. Every sequence is cut into windows of `seq_len` tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..core.errors import OutriderError
from ..prompts import encode_messages

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java")
MIN_SUPERVISED = 14  # DeepSpec drops samples with fewer supervised tokens


@dataclass
class Record:
    """One input unit: a chat (user turns, maybe with answers) or a document."""

    source: str
    turns: list[str] | None = None
    text: str | None = None


@dataclass
class Sequence:
    """Token ids and a 0/1 loss mask of the same length (1 = supervised)."""

    ids: list[int]
    mask: list[int]


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in (*TEXT_SUFFIXES, ".jsonl")
        )
        if not found:
            raise OutriderError(f"--data folder {path} holds no .jsonl or text files")
        return found
    if not path.is_file():
        raise OutriderError(f"--data file {path} does not exist")
    return [path]


def _jsonl_records(path: Path) -> Iterable[Record]:
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OutriderError(f"{where} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise OutriderError(f"{where} is not a JSON object")
        if "turns" in row:
            turns = row["turns"]
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) for t in turns)
            ):
                raise OutriderError(f"{where}: 'turns' must be a non-empty list of strings")
            yield Record(where, turns=turns)
        elif "text" in row:
            if not isinstance(row["text"], str):
                raise OutriderError(f"{where}: 'text' must be a string")
            yield Record(where, text=row["text"])
        else:
            raise OutriderError(f"{where} has neither 'turns' nor 'text'")


def read_records(paths: list[str | Path]) -> list[Record]:
    """Every record of every --data path (jsonl lines; one document per text file)."""
    records: list[Record] = []
    for given in paths:
        for path in _files(Path(given)):
            if path.suffix == ".jsonl":
                records.extend(_jsonl_records(path))
            else:
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    continue  # a binary file in a folder of sources
                if text.strip():
                    records.append(Record(str(path), text=text))
    if not records:
        raise OutriderError("--data holds no records")
    return records


def split_held_out(records: list[Record], n: int, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, held out): `n` records kept out of training, chosen reproducibly."""
    if n < 0:
        raise OutriderError(f"--held-out must be >= 0, got {n}")
    if n >= len(records):
        raise OutriderError(
            f"--held-out {n} leaves nothing to train on ({len(records)} records in --data)"
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held = sorted(order[:n])
    keep = sorted(order[n:])
    return [records[i] for i in keep], [records[i] for i in held]


Generate = Callable[[list[int]], list[int]]


def chat_sequences(
    record: Record, tokenizer: Any, generate: Generate | None, thinking: bool | None
) -> list[Sequence]:
    """One sequence per assistant turn: the conversation so far, then the answer (supervised).

    With `generate`, the target answers each user turn itself; without, `turns` alternate
    user / assistant and the given answers are used.
    """
    turns = record.turns or []
    messages: list[dict] = []
    out: list[Sequence] = []
    step = 1 if generate is not None else 2
    if generate is None and len(turns) < 2:
        raise OutriderError(
            f"{record.source}: with --no-regenerate, 'turns' must alternate user and "
            "assistant messages (at least one answer)"
        )
    for i in range(0, len(turns) - (step - 1), step):
        messages.append({"role": "user", "content": turns[i]})
        prompt = encode_messages(tokenizer, messages, thinking=thinking)
        if generate is not None:
            answer = generate(prompt)
            text = tokenizer.decode(answer, skip_special_tokens=True)
        else:
            text = turns[i + 1]
            answer = _rendered_answer(tokenizer, messages, text, prompt)
        out.append(Sequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        messages.append({"role": "assistant", "content": text})
    return out


def _rendered_answer(tokenizer, messages, text, prompt) -> list[int]:
    """The answer's tokens as the chat template writes them after `prompt` (end-of-turn
    marker included), else the plain answer and the end-of-sequence token."""
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": text}], tokenize=False
    )
    ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    if ids[: len(prompt)] == prompt:
        return ids[len(prompt) :]
    return list(tokenizer.encode(text, add_special_tokens=False)) + _end_of_turn(tokenizer)


def _end_of_turn(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(eos)]


def text_sequence(record: Record, tokenizer: Any) -> Sequence:
    ids = list(tokenizer.encode(record.text or "", add_special_tokens=False))
    return Sequence(ids, [1] * len(ids))


def windows(sequences: Iterable[Sequence], seq_len: int) -> list[Sequence]:
    """Cut sequences into windows of at most `seq_len` tokens; drop nearly unsupervised ones."""
    out = []
    for seq in sequences:
        for start in range(0, len(seq.ids), seq_len):
            ids, mask = seq.ids[start : start + seq_len], seq.mask[start : start + seq_len]
            pairs = sum(1 for a, b in zip(mask, mask[1:]) if a and b)
            if pairs >= MIN_SUPERVISED:
                out.append(Sequence(ids, mask))
    return out


def greedy_generator(target, max_new_tokens: int) -> Generate:
    """The target's own greedy answer to a prompt, ending at its end-of-turn token."""
    from mlx_lm.generate import generate_step

    eos = target.eos_token_ids

    def generate(prompt: list[int]) -> list[int]:
        out: list[int] = []
        for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_new_tokens):
            out.append(int(token))
            if out[-1] in eos or len(out) >= max_new_tokens:
                break
        return out

    return generate


def build_sequences(
    records: list[Record],
    tokenizer: Any,
    generate: Generate | None,
    thinking: bool | None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """Token sequences for every record (chats answered by `generate` when given)."""
    out: list[Sequence] = []
    for n, record in enumerate(records, 1):
        if record.turns is not None:
            out.extend(chat_sequences(record, tokenizer, generate, thinking))
        else:
            out.append(text_sequence(record, tokenizer))
        if progress is not None:
            progress(n, len(records))
    return out


def held_out_prompts(
    records: list[Record], tokenizer: Any, thinking: bool | None, prefix_tokens: int = 64
) -> list[list[int]]:
    """Prompts to measure acceptance on: a chat's first user turn, or a document's opening."""
    prompts = []
    for record in records:
        if record.turns is not None:
            messages = [{"role": "user", "content": record.turns[0]}]
            prompts.append(encode_messages(tokenizer, messages, thinking=thinking))
        else:
            ids = list(tokenizer.encode(record.text or "", add_special_tokens=False))
            prompt = ids[: min(prefix_tokens, max(1, len(ids) // 2))]
            if prompt:
                prompts.append(prompt)
    return prompts
