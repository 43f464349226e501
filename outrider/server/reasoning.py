"""Split a model's streamed text into reasoning and answer text.

Reasoning is `<think>…</think>` (Qwen, DeepSeek and most others) or Gemma-4's thought channel
`<|channel>thought …<channel|>`; the chat template says which. Markers can arrive split across
chunks, so text that could still become a marker is held back until it cannot. A prompt that
already opened a think block (templates that prefill `<think>`) starts the splitter inside it.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
THINK = (OPEN, CLOSE)
GEMMA_CHANNEL = ("<|channel>thought", "<channel|>")


def markers_for(template: str) -> tuple[str, str]:
    """The reasoning markers a chat template's model uses."""
    return GEMMA_CHANNEL if "<|channel>" in template else THINK


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt_text: str, markers: tuple[str, str] = THINK) -> bool:
    """Whether the rendered prompt leaves a think block open for the model to continue."""
    return prompt_text.rfind(markers[0]) > prompt_text.rfind(markers[1])


def close_thinking(prompt_text: str, markers: tuple[str, str] = THINK) -> str:
    """The prompt with a think block it leaves open closed empty. For a request that turned
    thinking off on a template that opens one whatever it is told (LFM2.5's does): the model
    then answers at once, as templates that honour `enable_thinking=False` render it."""
    if not prompt_opens_thinking(prompt_text, markers):
        return prompt_text
    gap = "\n" if prompt_text.endswith("\n") else "\n\n"  # Qwen3's "<think>\n\n</think>\n\n"
    return f"{prompt_text}{gap}{markers[1]}\n\n"


class ThinkSplitter:
    """Feed text deltas; get back ("reasoning" | "content", text) pieces in order."""

    def __init__(self, in_thinking: bool = False, markers: tuple[str, str] = THINK) -> None:
        self.in_thinking = in_thinking
        self.open, self.close = markers
        self._buf = ""
        self._seen_content = False
        self._seen_reasoning = False
        self._after_think = in_thinking

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            marker = self.close if self.in_thinking else self.open
            i = self._buf.find(marker)
            # Only a think block at the very start of the answer opens reasoning.
            if not self.in_thinking and (self._seen_content or i > 0 and self._buf[:i].strip()):
                self._emit(out, "content", self._buf)
                self._buf = ""
                break
            if i >= 0:
                self._emit(out, "reasoning" if self.in_thinking else "content", self._buf[:i])
                self._buf = self._buf[i + len(marker) :]
                if self.in_thinking:
                    self._after_think = True
                self.in_thinking = not self.in_thinking
                continue
            keep = _partial_suffix(self._buf, marker)
            if not self.in_thinking and not self._buf[: len(self._buf) - keep].strip():
                break  # only whitespace so far: a think block may still open
            self._emit(
                out, "reasoning" if self.in_thinking else "content", self._buf[: -keep or None]
            )
            self._buf = self._buf[len(self._buf) - keep :] if keep else ""
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        """Flush what was held back (an unterminated think block stays reasoning)."""
        out: list[tuple[str, str]] = []
        self._emit(out, "reasoning" if self.in_thinking else "content", self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if kind == "reasoning" and not self._seen_reasoning:
            text = text.lstrip()
            self._seen_reasoning = bool(text)
        if kind == "content":
            if not self._seen_content and self._after_think:
                text = text.lstrip()
            if text:
                self._seen_content = True
        if text:
            out.append((kind, text))
