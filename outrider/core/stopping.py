"""End generation exactly where plain decoding would: stop tokens, max tokens, stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# A model never writes a tool's response itself: the opener means it has begun to imagine one.
# Gemma-4 goes on past its tool call into `<|tool_response>…` until max_tokens otherwise (the
# reference Mac project's users met it). Where the vocabulary holds one as a single token, it
# ends generation as end-of-turn does, in every mode and in plain decoding alike.
TOOL_RESPONSE_OPENERS = ("<|tool_response>",)


def opener_ids(tokenizer: Any) -> set[int]:
    """The ids of `TOOL_RESPONSE_OPENERS` that are single tokens of `tokenizer`'s vocabulary."""
    vocab = getattr(tokenizer, "get_vocab", None)
    table = vocab() if callable(vocab) else {}
    return {int(table[t]) for t in TOOL_RESPONSE_OPENERS if t in table}


class Stopper:
    """Consumes committed tokens one at a time and says when generation is over.

    A stop token ends generation and is not emitted. A stop string ends generation at the first
    token whose addition makes the text contain it; the text is later cut before the string.
    """

    def __init__(
        self,
        max_tokens: int,
        stop_tokens: set[int],
        stop_strings: Sequence[str] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        if stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode text")
        self.max_tokens = max_tokens
        self.stop_tokens = stop_tokens
        self.stop_strings = [s for s in stop_strings if s]
        self.decode = decode
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._window = max((len(s) for s in self.stop_strings), default=0) + 8

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def feed(self, committed: list[int]) -> list[int]:
        """Returns the prefix of `committed` that is emitted; sets finish_reason when done."""
        kept: list[int] = []
        for tok in committed:
            if self.finish_reason is not None:
                break
            if len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
                break
            if tok in self.stop_tokens:
                self.finish_reason = "stop"
                break
            self.tokens.append(tok)
            kept.append(tok)
            if self.stop_strings and self._hits_stop_string():
                self.finish_reason = "stop"
                break
            if len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
        return kept

    def _hits_stop_string(self) -> bool:
        tail = self.decode(self.tokens[-self._window :])
        return any(s in tail for s in self.stop_strings)

    def cut_text(self, text: str) -> str:
        """Cut decoded text before the first stop string (stop strings are not emitted)."""
        cut = min((i for s in self.stop_strings if (i := text.find(s)) >= 0), default=-1)
        return text if cut < 0 else text[:cut]
