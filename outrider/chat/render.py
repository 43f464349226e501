"""Chat messages (OpenAI shape) -> the token ids the target sees, through its chat template
(or a request's own template, rendered in the sandbox), with a cheap length bound checked
before the tokenizer runs."""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import PromptError
from ..core.prefix_entry import shared_prefix
from .reasoning import close_thinking, markers_for, prompt_opens_thinking
from .template_sandbox import TemplateRefused, render_untrusted
from .text import lone_surrogate_at, unseen

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _text(content: Any) -> str:
    """Message content as text: strings pass, content-part lists are joined (text parts; a
    part the model cannot see becomes a line saying so, `text.unseen`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", None):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(unseen(str(part.get("type"))))
        return "".join(parts)
    raise PromptError("message content must be a string or a list of content parts")


def normalize(messages: list[dict]) -> list[dict]:
    """What chat templates can render: text content, tool-call arguments as objects, and
    system messages only at the start. A later one becomes a <system-reminder> (which templates
    that insist on a leading system message accept) where it stands: appended to the user turn
    or tool result before it, else put before the next user turn. Claude Code sends such
    entries after tool results; held for the next user turn they would pile up after the last
    tool result, and the prompt would no longer end with it."""
    out: list[dict] = []
    reminders: list[str] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        msg = {"role": role, "content": _text(m.get("content"))}
        if role in ("system", "developer"):
            if out and all(o["role"] == "system" for o in out):
                out[0]["content"] += "\n\n" + msg["content"]
            elif not out:
                out.append({"role": "system", "content": msg["content"]})
            elif out[-1]["role"] in ("user", "tool") and not reminders:
                if msg["content"]:
                    note = f"<system-reminder>{msg['content']}</system-reminder>"
                    out[-1]["content"] += "\n" + note
            else:
                reminders.append(msg["content"])
            continue
        if reminders and role == "user":
            notes = "".join(f"<system-reminder>{r}</system-reminder>\n" for r in reminders)
            msg["content"] = notes + msg["content"]
            reminders = []
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise PromptError(
                            f"tool call arguments of message {i} are not valid JSON"
                        ) from None
                fn["arguments"] = args or {}
                calls.append({"id": tc.get("id"), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    if reminders:
        notes = "".join(f"<system-reminder>{r}</system-reminder>" for r in reminders)
        out.append({"role": "user", "content": notes})
    return out


def template_text(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    return tpl if isinstance(tpl, str) else json.dumps(tpl or "")


def capabilities(tokenizer: Any) -> dict[str, bool]:
    tpl = template_text(tokenizer)
    return {
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "tools": "tools" in tpl,
        "thinking": "enable_thinking" in tpl or "<think>" in tpl,
        "enable_thinking": "enable_thinking" in tpl,
        "reasoning_effort": "reasoning_effort" in tpl,
    }


def nearest_efforts(effort: str | None) -> list[str | None]:
    """`effort`, then the other levels by distance, ties toward less thinking: templates know
    different words (one has low / medium / xhigh and refuses "high")."""
    if effort not in EFFORTS:
        return [effort]
    i = EFFORTS.index(effort)
    return sorted(EFFORTS, key=lambda e: (abs(EFFORTS.index(e) - i), EFFORTS.index(e) > i))


class PromptTooLong(Exception):
    """The prompt cannot fit the context window; `tokens` is its length (or a lower bound)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.tokens = tokens


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (the longest vocabulary entry): a text of
    C characters needs at least C / this many tokens, whatever the tokenizer does with it."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        longest = 0
    try:
        _LONGEST[tokenizer] = longest
    except TypeError:
        pass
    return longest


def encode_within(
    tokenizer: Any, text: str, window: int | None, special: bool = False
) -> list[int]:
    """Token ids of `text`, refusing a text that cannot fit `window` tokens before tokenizing
    it (tokenizing megabytes takes seconds of CPU and a lot of memory)."""
    longest = longest_token_chars(tokenizer) if window else 0
    if window and longest and len(text) > window * longest:
        raise PromptTooLong(-(-len(text) // longest))
    if special:
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


class Rendered(NamedTuple):
    """A chat rendered for the target: its ids, whether it leaves a think block open, and two
    places a prefix-cache snapshot serves later requests on targets whose state cannot be cut
    back (core/prefix_cache.py); 0 where not known.

    `boundary`: where the last message ended, before the template opened the assistant's turn.
    The conversation's next turn renders the same up to there, whereas what follows
    (`<|im_start|>assistant\n<think>\n`, say) is rendered otherwise once the answer is in the
    history. `system_end`: where the system message (with the tools) ended, which every new
    conversation of the same agent shares: Claude Code's runs to tens of thousands of tokens."""

    ids: list[int]
    opens: bool
    boundary: int = 0
    system_end: int = 0

    @property
    def marks(self) -> tuple[int, ...]:
        """The snapshot places, for `Pipeline.stream(snapshot_at=...)`."""
        return tuple(p for p in (self.system_end, self.boundary) if p > 0)


class _Latest:
    """The values of a costly function for its latest `size` keys, shared by the threads that
    render requests (a request's own template kwargs make new keys, so it must stay small)."""

    def __init__(self, size: int) -> None:
        self.size, self._kept, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key: tuple, compute: Any) -> Any:
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        value = compute()  # outside the lock: another thread may compute it too, harmlessly
        with self._lock:
            self._kept[key] = value
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value


_TURN_OPENERS = _Latest(64)  # (tokenizer, template, settings) -> tokens opening a turn
_SYSTEM_IDS = _Latest(16)  # (tokenizer, template, system message, settings) -> its ids alone
PROBE = [{"role": "user", "content": "Hello."}]


def generation_prompt_tokens(
    tokenizer: Any, template: str | None, kwargs: dict[str, Any], close: tuple[str, str] | None
) -> int:
    """How many tokens the template appends to open the assistant's turn (with a think block
    closed by `close_thinking` when `close` gives its markers, as `render_chat` does), measured
    once per tokenizer and settings on a probe conversation: 0 where the two renderings do not
    share a prefix, or rendering fails. Tools are left out: they render before the turns."""
    kwargs = {k: v for k, v in kwargs.items() if k != "tools"}

    def measure() -> int:
        try:
            text = _apply(tokenizer, PROBE, template, False, kwargs)
            if close is not None:
                text = close_thinking(text, close)
            with_turn = tokenizer.encode(text, add_special_tokens=False)
            without = tokenizer.encode(_apply(tokenizer, PROBE, template, False, kwargs, False),
                                       add_special_tokens=False)  # fmt: skip
        except Exception:  # a template that cannot render the probe: no boundary
            return 0
        same = list(with_turn[: len(without)]) == list(without)
        return len(with_turn) - len(without) if same else 0

    return _TURN_OPENERS.get((id(tokenizer), template, close, _digest(kwargs)), measure)


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool | None = None,
    reasoning_effort: str | None = None,
    extra: dict | None = None,
    *,
    template: str | None = None,
    continue_final: bool = False,
    window: int | None = None,
) -> Rendered:
    """The prompt ids, whether the prompt leaves a think block open, and where the last
    message ended (`Rendered`).

    `template` is a request's own chat template (rendered in the sandbox); `continue_final`
    extends the last (assistant) message instead of opening a new turn; a prompt that cannot
    fit `window` tokens raises PromptTooLong."""
    msgs = normalize(messages)
    if continue_final and (not msgs or msgs[-1]["role"] != "assistant"):
        raise PromptError("continuing the final message needs an assistant message last")
    if template is None and not getattr(tokenizer, "chat_template", None):
        text = "\n\n".join(m["content"] for m in msgs)
        return Rendered(encode_within(tokenizer, text, window, special=True), False)
    caps = capabilities(tokenizer) if template is None else _template_caps(template)
    kwargs: dict[str, Any] = dict(extra or {})
    if thinking is not None and caps["enable_thinking"]:
        kwargs["enable_thinking"] = thinking
    if reasoning_effort is not None and caps["reasoning_effort"]:
        kwargs["reasoning_effort"] = reasoning_effort
    if tools:
        kwargs["tools"] = tools
    efforts = nearest_efforts(kwargs.get("reasoning_effort"))
    for i, effort in enumerate(efforts):
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        try:
            text = _apply(tokenizer, msgs, template, continue_final, kwargs)
            break
        except TemplateRefused as e:
            raise PromptError(str(e), param="chat_template") from None
        except Exception as e:
            if i + 1 < len(efforts):
                continue  # a template that knows other effort words: try the nearest next
            raise PromptError(f"could not apply chat template: {e}") from None
    if lone_surrogate_at(text) is not None:  # a template can build one from escapes
        raise PromptError("the chat template produced text with a lone UTF-16 surrogate")
    tpl = template if template is not None else template_text(tokenizer)
    markers = markers_for(tpl)
    close = markers if thinking is False and not continue_final else None
    if close is not None:  # a template may open a think block anyway
        text = close_thinking(text, close)
    opens = not continue_final and prompt_opens_thinking(text, markers)
    ids = encode_within(tokenizer, text, window)
    if not ids:
        raise PromptError("the chat template rendered an empty prompt")
    suffix = 0 if continue_final else generation_prompt_tokens(tokenizer, template, kwargs, close)
    boundary = len(ids) - suffix if 0 < suffix < len(ids) else 0
    return Rendered(ids, opens, boundary, system_end(tokenizer, template, msgs, kwargs, ids))


def _digest(kwargs: dict[str, Any]) -> str:
    """A short key for template settings (a tools list runs to tens of kilobytes)."""
    text = repr(sorted(kwargs.items())).encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()


def system_end(
    tokenizer: Any, template: str | None, msgs: list[dict], kwargs: dict, ids: list[int]
) -> int:
    """Where `ids` stop following the system message rendered alone (tools included), or 0
    with no system message (or none that renders alone). Its ids are kept for the latest 16
    system messages (`_SYSTEM_IDS`), so a conversation pays the rendering once."""
    if len(msgs) < 2 or msgs[0]["role"] != "system":
        return 0
    digest = hashlib.sha256(msgs[0]["content"].encode("utf-8", "surrogatepass")).hexdigest()

    def render_alone() -> np.ndarray:
        try:
            text = _apply(tokenizer, msgs[:1], template, False, kwargs, False)
            return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        except Exception:  # a template that wants a user turn: no system boundary
            return np.zeros(0, dtype=np.int64)

    alone = _SYSTEM_IDS.get((id(tokenizer), template, digest, _digest(kwargs)), render_alone)
    end = shared_prefix(alone, np.asarray(ids, dtype=np.int64))
    return end if end < len(ids) else 0


def _template_caps(template: str) -> dict[str, bool]:
    return {
        "enable_thinking": "enable_thinking" in template,
        "reasoning_effort": "reasoning_effort" in template,
    }


def _apply(
    tokenizer: Any,
    msgs: list[dict],
    template: str | None,
    continue_final: bool,
    kwargs: dict,
    turn: bool = True,
) -> str:
    """The template's text for `msgs`; `turn` False leaves out the generation prompt."""
    if template is None:
        return tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=turn and not continue_final,
            continue_final_message=continue_final,
            **kwargs,
        )
    specials = {
        k: v
        for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
        if isinstance(v, (str, list))
    }
    context = {**specials, **kwargs, "messages": msgs}
    context["add_generation_prompt"] = turn and not continue_final
    text = render_untrusted(template, context)
    if continue_final:  # as transformers does: cut after the final message's own text
        final = msgs[-1]["content"].strip()
        if final not in text:
            raise TemplateRefused("the request's chat template does not render the final message")
        text = text[: text.rindex(final) + len(final)]
    return text
