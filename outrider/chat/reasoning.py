"""Split a model's streamed text into reasoning and answer text.

Reasoning is `<think>…</think>` (Qwen, DeepSeek and most others), Gemma-4's thought channel
`<|channel>thought …<channel|>`, or a channel transcript (`ChannelSplitter`: Muse-Glimmer's
`to=self` / `to=user` channels, the Harmony layout's `analysis` / `final`); the chat template
says which. Markers can arrive split across chunks, so text that could still become a marker is
held back until it cannot. A prompt that already opened a think block (templates that prefill
`<think>`) starts the splitter inside it.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
THINK = (OPEN, CLOSE)
GEMMA_CHANNEL = ("<|channel>thought", "<channel|>")
CHANNELS = ("<|message|>", "<|end|>")  # a transcript of channels: `ChannelSplitter`


def markers_for(template: str) -> tuple[str, str]:
    """The reasoning markers a chat template's model uses."""
    if "<|message|>" in template:
        return CHANNELS
    return GEMMA_CHANNEL if "<|channel>" in template else THINK


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt_text: str, markers: tuple[str, str] = THINK) -> bool:
    """Whether the rendered prompt leaves a think block open for the model to continue (for
    a channel transcript: a channel to the model itself)."""
    if markers == CHANNELS:
        body = prompt_text.rfind(CHANNELS[0])
        if body < max(prompt_text.rfind(end) for end in _ENDS):
            return False
        return bool(_SELF.search(prompt_text[max(prompt_text.rfind("<|start|>"), 0) : body]))
    return prompt_text.rfind(markers[0]) > prompt_text.rfind(markers[1])


def close_thinking(prompt_text: str, markers: tuple[str, str] = THINK) -> str:
    """The prompt with a think block it leaves open closed empty. For a request that turned
    thinking off on a template that opens one whatever it is told (LFM2.5's does): the model
    then answers at once, as templates that honour `enable_thinking=False` render it."""
    if markers == CHANNELS or not prompt_opens_thinking(prompt_text, markers):
        return prompt_text  # a channel transcript's own turn is the model's to close
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


# A channel's header runs to `<|message|>` and names who it is for: the model itself
# (Muse-Glimmer's `to=self`, the Harmony layout's `analysis` channel) is reasoning, anyone else
# (`to=user`, `final`, a tool's `to=functions.x`) the answer. A body ends at one of these.
_SELF = re.compile(r"to\s*=\s*self\b|<\|channel\|>\s*analysis\b")
_ENDS = ("<|end|>", "<|eom|>", "<|return|>", "<|call|>")
_MARKER = re.compile(r"<\|[a-z_]{1,24}\|>")
_PARTIAL = re.compile(r"<(\|[a-z_]{0,24}\|?)?")  # the start of a marker, cut by a chunk
HEADER_MAX = 96  # characters a header may take; text without `<|message|>` by then is an answer


class ChannelSplitter:
    """`ThinkSplitter`'s job for a channel transcript: `<|start|>assistant to=self<|message|>
    reasoning<|end|><|start|>assistant to=user<|message|>answer<|return|>` gives ("reasoning",
    "reasoning") and ("content", "answer"), whatever the chunking; the markers never reach the
    client (mlx-vlm's Muse-Glimmer processor keeps the last `to=user` body the same way). Text
    that opens with no header within `HEADER_MAX` characters is all answer."""

    def __init__(self, in_thinking: bool = False) -> None:
        """`in_thinking`: the prompt opened the model's own channel (`prompt_opens_thinking`)."""
        self._buf = ""
        # inside a body: its kind; None: reading a header
        self._kind: str | None = "reasoning" if in_thinking else None
        self._plain = False  # no channels at all: everything is the answer
        self._seen = in_thinking  # a channel was opened

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._kind is None and not self._plain:
                i = self._buf.find(CHANNELS[0])
                if i < 0:
                    if len(self._buf) <= HEADER_MAX:
                        break  # a header still arriving
                    if self._seen:  # text after a channel closed, with no header: answer
                        self._kind = "content"
                    else:
                        self._plain = True  # a model that answered without channels
                    continue
                header = self._buf[:i]
                self._buf = self._buf[i + len(CHANNELS[0]) :]
                self._kind = "reasoning" if _SELF.search(header) else "content"
                self._seen = True
                continue
            m = _MARKER.search(self._buf)
            if m is None:
                cut = self._buf.rfind("<")  # a marker may be arriving: hold it back
                keep = len(self._buf) - cut if _PARTIAL.fullmatch(self._buf[cut:]) else 0
                self._emit(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._emit(out, self._buf[: m.start()])
            self._buf = self._buf[m.end() :]
            if not self._plain and (m.group(0) in _ENDS or m.group(0) == "<|start|>"):
                self._kind = None  # the next channel's header follows
        return out

    def finish(self) -> list[tuple[str, str]]:
        """Flush what was held back: an unfinished body as its kind, a lone header as
        answer text only where no channel was seen."""
        out: list[tuple[str, str]] = []
        rest, self._buf = self._buf, ""
        if self._kind is not None or self._plain:
            self._emit(out, _MARKER.sub("", rest))
        elif CHANNELS[0] not in rest and not _MARKER.search(rest):
            self._kind = "content"
            self._emit(out, rest)
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if text:
            out.append(("content" if self._plain else self._kind or "content", text))
