"""Training data: prompt/text files in, fixed-length token windows with loss masks out.

A record is a chat (`{"turns": [...]}`) or a document (`{"text": ...}`, or a plain text/code
file). Chats are answered by the target itself first (self-distillation, as DeepSpec regenerates
its answers), so the drafter learns what *this* target writes; only the answers are supervised.
Documents are supervised everywhere. Every sequence is cut into windows of `seq_len` tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
    if path.suffix == ".json":
        raise OutriderError(f"--data {path}: use JSON Lines (.jsonl), one record per line")
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


# (prompts, max new tokens or None for the default) -> the target's answers
Generate = Callable[..., list[list[int]]]


def answered_chats(
    records: list[Record],
    tokenizer: Any,
    generate: Generate,
    thinking: bool | None,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = 256,
) -> list[Sequence]:
    """Self-distillation: the target answers every user turn itself, turn by turn (all chats'
    turn i together, in chunks); one sequence per answer, the conversation so far unsupervised.
    `generate` may be an `Answers` (which then reports progress itself)."""
    ask = generate if isinstance(generate, Answers) else Answers(generate, progress=progress)
    convs: list[list[dict]] = [[] for _ in records]
    ask.phase(sum(len(r.turns or []) for r in records))
    out: list[Sequence] = []
    for i in range(max(len(r.turns or []) for r in records)):
        active = [j for j, r in enumerate(records) if i < len(r.turns or [])]
        for lo in range(0, len(active), chunk):
            group = active[lo : lo + chunk]
            prompts = []
            for j in group:
                convs[j].append({"role": "user", "content": records[j].turns[i]})
                prompts.append(encode_messages(tokenizer, convs[j], thinking=thinking))
            for j, prompt, answer in zip(group, prompts, ask(prompts)):
                out.append(Sequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
                text = tokenizer.decode(answer, skip_special_tokens=True)
                convs[j].append({"role": "assistant", "content": text})
    ask.end_phase()
    return out


def given_chat(record: Record, tokenizer: Any, thinking: bool | None) -> list[Sequence]:
    """--no-regenerate: `turns` alternate user / assistant; the given answers are supervised."""
    turns = record.turns or []
    if len(turns) < 2:
        raise OutriderError(
            f"{record.source}: with --no-regenerate, 'turns' must alternate user and "
            "assistant messages (at least one answer)"
        )
    messages: list[dict] = []
    out = []
    for i in range(0, len(turns) - 1, 2):
        messages.append({"role": "user", "content": turns[i]})
        prompt = encode_messages(tokenizer, messages, thinking=thinking)
        answer = _rendered_answer(tokenizer, messages, turns[i + 1], prompt)
        out.append(Sequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        messages.append({"role": "assistant", "content": turns[i + 1]})
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


def continued_documents(
    records: list[Record],
    tokenizer: Any,
    generate: Generate,
    seq_len: int,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = 256,
) -> list[Sequence]:
    """Self-distillation for documents: the target continues the first half of every
    `seq_len` window; its continuation, not the document's own text, is supervised.
    `generate` may be an `Answers` (which then reports progress itself)."""
    ask = generate if isinstance(generate, Answers) else Answers(generate, progress=progress)
    half = seq_len // 2
    prompts = []
    for record in records:
        ids = text_sequence(record, tokenizer).ids
        prompts += [ids[i : i + half] for i in range(0, len(ids), seq_len) if len(ids) - i >= 8]
    ask.phase(len(prompts))
    out = []
    for lo in range(0, len(prompts), chunk):
        group = prompts[lo : lo + chunk]
        for prompt, answer in zip(group, ask(group, seq_len - half)):
            out.append(Sequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    ask.end_phase()
    return out


def build_sequences(
    records: list[Record],
    tokenizer: Any,
    generate: Generate | None,
    thinking: bool | None,
    progress: Callable[[int, int], None] | None = None,
    continue_text: int = 0,
    chunk: int = 256,
) -> list[Sequence]:
    """Token sequences for every record: chats answered by `generate` when given; documents as
    they are, or (continue_text = window length) continued by `generate`. The target is asked
    in chunks of `chunk` prompts, always in the same order; pass an `Answers` with a store to
    keep every chunk's answers as they come (and reuse the ones an earlier run kept)."""
    ask = generate
    if generate is not None and not isinstance(generate, Answers):
        ask = Answers(generate, progress=progress)
    chats = [r for r in records if r.turns is not None]
    docs = [r for r in records if r.turns is None]
    if continue_text and ask is not None:
        out = continued_documents(docs, tokenizer, ask, continue_text, chunk=chunk)
    else:
        out = [text_sequence(r, tokenizer) for r in docs]
    if chats and ask is not None:
        out.extend(answered_chats(chats, tokenizer, ask, thinking, chunk=chunk))
    else:
        for record in chats:
            out.extend(given_chat(record, tokenizer, thinking))
    return out


# -- self-distillation that survives an interruption ------------------------------------------


def records_digest(records: list[Record]) -> str:
    """A fingerprint of the records' content and order (what the target is asked)."""
    body = json.dumps([[r.turns, r.text] for r in records], ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _prompts_key(prompts: list[list[int]], max_tokens: int | None) -> str:
    body = json.dumps([max_tokens, [[int(t) for t in p] for p in prompts]], separators=(",", ":"))
    return hashlib.sha256(body.encode("ascii")).hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AnswerStore:
    """The target's self-distilled answers, kept on disk chunk by chunk as they are made.

    `folder/manifest.json` says what they were made for (model, data, settings); chunk `k` is
    `folder/chunk_<k>.safetensors` (its answers' tokens and lengths, and a hash of the prompts
    and token limit it answered), written to a temporary name, fsynced and renamed, so a chunk
    on disk is always whole. A resumed run with the same manifest reads the chunks back; one
    with another manifest is refused (rather than train on answers to other questions).
    """

    MANIFEST = "manifest.json"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def open(cls, folder: str | Path, manifest: dict, resume: bool) -> AnswerStore:
        """The store for `manifest`: the kept one when resuming (refused when it was made for
        anything else), else a fresh, empty one."""
        folder = Path(folder)
        path = folder / cls.MANIFEST
        if resume and path.is_file():
            kept = json.loads(path.read_text())
            if kept != manifest:
                raise OutriderError(
                    f"{folder} holds the target's answers for other settings "
                    f"({_differences(kept, manifest)}); resume with the same settings, or "
                    f"delete {folder} to have the target answer again"
                )
            return cls(folder)
        shutil.rmtree(folder, ignore_errors=True)  # no manifest: nothing whole was kept
        folder.mkdir(parents=True)
        tmp = folder / (cls.MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _fsync(tmp)
        tmp.replace(path)
        _fsync(folder)
        return cls(folder)

    def _chunk(self, k: int) -> Path:
        return self.folder / f"chunk_{k:06d}.safetensors"

    def get(
        self, k: int, prompts: list[list[int]], max_tokens: int | None
    ) -> list[list[int]] | None:
        """Chunk k's kept answers, or None when it was not made yet."""
        import mlx.core as mx

        path = self._chunk(k)
        if not path.is_file():
            return None
        arrays, meta = mx.load(str(path), return_metadata=True)
        if meta.get("prompts") != _prompts_key(prompts, max_tokens):
            raise OutriderError(
                f"{path} answers other prompts than this run asks (the tokenizer or its chat "
                f"template changed?); delete {self.folder} to have the target answer again"
            )
        tokens = np.array(arrays["tokens"]).tolist()
        ends = np.cumsum(np.array(arrays["lengths"])).tolist()
        return [tokens[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def put(
        self, k: int, prompts: list[list[int]], max_tokens: int | None, answers: list[list[int]]
    ) -> None:
        import mlx.core as mx

        tokens = np.array([t for a in answers for t in a], dtype=np.int32)
        lengths = np.array([len(a) for a in answers], dtype=np.int32)
        path = self._chunk(k)
        tmp = path.with_name(path.stem + ".tmp.safetensors")
        mx.save_safetensors(
            str(tmp),
            {"tokens": mx.array(tokens), "lengths": mx.array(lengths)},
            metadata={"prompts": _prompts_key(prompts, max_tokens)},
        )
        _fsync(tmp)
        tmp.replace(path)
        _fsync(self.folder)

    @staticmethod
    def kept_chunks(folder: str | Path) -> int:
        """How many whole chunks `folder` holds (0 when it is not a store)."""
        folder = Path(folder)
        if not (folder / AnswerStore.MANIFEST).is_file():
            return 0
        return sum(1 for p in folder.glob("chunk_*.safetensors") if ".tmp" not in p.name)


def _differences(kept: dict, now: dict) -> str:
    """What changed between two manifests, for one line of error."""
    names = {
        "data": "the training prompts differ (--data, --held-out or --seed)",
        "model_config": "the model's config differs",
    }
    out = []
    for key in sorted(set(kept) | set(now)):
        if kept.get(key) != now.get(key):
            out.append(names.get(key) or f"{key} was {kept.get(key)!r}, now {now.get(key)!r}")
    return "; ".join(out)


class Answers:
    """`generate` asked chunk by chunk, in a fixed order (chunk k is the k-th call). With a
    `store`, each chunk's answers are kept as soon as they exist, and a chunk an earlier run
    kept is read back instead of generated again, so a resumed self-distillation gives exactly
    the answers of an uninterrupted one. `progress(done, total)` follows each phase (documents,
    then chats); a resumed phase first reports what was kept, then each new chunk."""

    def __init__(
        self,
        generate: Generate,
        store: AnswerStore | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.generate, self.store, self.progress = generate, store, progress
        self.chunks = 0  # chunks asked for so far: the next one's number
        self.kept = 0  # prompts whose answers are in the store
        self.reused = 0  # of those, read back from an earlier run
        self.done = self.total = 0
        self._unreported = False

    def phase(self, total: int) -> None:
        self.done, self.total, self._unreported = 0, total, False

    def end_phase(self) -> None:
        if self._unreported:
            self._report()

    def _report(self) -> None:
        self._unreported = False
        if self.progress is not None:
            self.progress(self.done, self.total)

    def __call__(self, prompts: list[list[int]], max_tokens: int | None = None) -> list[list[int]]:
        k = self.chunks
        answers = None if self.store is None else self.store.get(k, prompts, max_tokens)
        self.chunks += 1
        if answers is not None:  # reported with the next new chunk, or at the phase's end
            self.reused += len(prompts)
            self.kept += len(prompts)
            self.done += len(prompts)
            self._unreported = True
            return answers
        if self._unreported:
            self._report()  # where a resumed phase picks up, before the target runs
        if max_tokens is None:
            answers = self.generate(prompts)
        else:
            answers = self.generate(prompts, max_tokens)
        if self.store is not None:
            self.store.put(k, prompts, max_tokens, answers)
            self.kept += len(prompts)
        self.done += len(prompts)
        self._report()  # after the chunk is kept: an interrupt from here on loses nothing
        return answers


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


class Windows:
    """The training windows as padded arrays, in a reproducible per-epoch order."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, seed: int) -> None:
        self.ids, self.mask, self.seed = ids, mask, seed
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], seq_len: int, seed: int) -> Windows:
        ids = np.zeros((len(seqs), seq_len), dtype=np.int32)
        mask = np.zeros((len(seqs), seq_len), dtype=bool)
        for i, s in enumerate(seqs):
            ids[i, : len(s.ids)] = s.ids
            mask[i, : len(s.mask)] = np.array(s.mask, dtype=bool)
        return cls(ids, mask, seed)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        rows = []
        for p in range(step * size, (step + 1) * size):
            epoch = p // n
            if epoch not in self._orders:
                self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(n)
            rows.append(self._orders[epoch][p % n])
        return self.ids[rows], self.mask[rows]
