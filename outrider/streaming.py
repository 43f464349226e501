"""A generation's steps as the caller sees them: text decoded as tokens land (held back while
it could still become a stop string), chunks, and the Result at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .core.events import Result, Round
from .core.round import Step
from .core.stopping import Stopper


class _FullDecode:
    """Fallback detokenizer for tokenizers without mlx-lm's streaming one (re-decodes all)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self._tokens, self.text = tokenizer, [], ""

    def add_token(self, token: int) -> None:
        self._tokens.append(token)
        self.text = self._tokenizer.decode(self._tokens).rstrip("\ufffd")

    def finalize(self) -> None:
        self.text = self._tokenizer.decode(self._tokens)


class TextAssembler:
    """Incremental text for streamed tokens (mlx-lm's streaming detokenizer), cut before a stop
    string; text that could still turn into a stop string is held back until it cannot."""

    def __init__(self, tokenizer: Any, stopper: Stopper) -> None:
        self._detok = None
        if tokenizer is not None:
            self._detok = getattr(tokenizer, "detokenizer", None) or _FullDecode(tokenizer)
        self._stopper = stopper
        self._hold = max((len(s) for s in stopper.stop_strings), default=1) - 1
        self._emitted = 0
        self.text = ""

    def add(self, tokens: list[int], done: bool) -> str:
        if self._detok is None:
            return ""
        for t in tokens:
            self._detok.add_token(t)
        if done:
            self._detok.finalize()
        full = self._detok.text
        if self._stopper.stop_strings:
            cut = self._stopper.cut_text(full)
            safe = cut if (done or len(cut) < len(full)) else cut[: len(cut) - self._hold]
        else:
            safe = full
        self.text = safe
        delta = safe[self._emitted :]
        self._emitted = max(self._emitted, len(safe))
        return delta


def _stop_only(step: Step) -> bool:
    """A step that only says generation was cancelled: no forward ran, nothing was drafted or
    kept, so it is no round (a partial result's rounds and accept length stay those run)."""
    return step.finish_reason == "cancelled" and not step.committed and not step.drafted


@dataclass
class Chunk:
    """A piece of streamed output: new text, the tokens behind it, and the step it came from."""

    text: str
    tokens: list[int]
    step: Step
    result: Result | None = None  # set on the last chunk
    earlier: tuple[Step, ...] = ()  # steps merged into this chunk before `step` (the server)


class Collector:
    """Turns one generation's steps into chunks, and its last step into the Result."""

    def __init__(self, result: Result, text: TextAssembler) -> None:
        self.result, self.text = result, text
        self.decode_start = time.perf_counter()

    def add(self, step: Step) -> Chunk:
        result = self.result
        if step.source == "prefill":
            result.prefill_seconds = step.seconds
            self.decode_start = time.perf_counter()
        elif step.source == "draft" and not _stop_only(step):
            shown = (step.drafted, step.accepted, step.committed, step.seconds)
            result.rounds.append(Round(*shown, step.ahead, step.dropped))
        elif step.source == "plain" and step.committed:
            result.plain_steps += 1
        result.tokens.extend(step.committed)
        result.budget_forced |= step.closed
        done = step.finish_reason is not None
        delta = self.text.add(step.committed, done)
        if not done:
            return Chunk(delta, step.committed, step)
        result.finish_reason = step.finish_reason
        result.text = self.text.text
        result.decode_seconds = time.perf_counter() - self.decode_start
        result.peak_memory_gb = mx.get_peak_memory() / 1e9
        return Chunk(delta, step.committed, step, result)
