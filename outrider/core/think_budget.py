"""A reasoning budget: after N thinking tokens the model is made to close its thinking.

The engine counts the tokens a generation writes inside a think block. The first token that
would exceed the budget is not kept: the closing text (a short message, the closer, a blank
line) takes its place, committed as if the model had written it, and the model goes on from
there to its answer. A closer the model writes itself is always kept, so a block that ends on
its own at the limit is never cut. It fires at most once a generation.

The decision depends only on the sequence of committed tokens, never on how rounds grouped
them, so every mode (and plain decoding) forces the closing at the same position and the
output stays that of plain decoding with the same budget. The loop (`core/round.py`
`settle`, `core/loop.py`) commits the closing: its first token in place of the one cut, the
rest in one round whose drafts are accepted without being verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MESSAGE = "I have to answer now."

# The single tokens that open and close a block of each reasoning syntax (chat/reasoning.py's
# markers): Gemma-4's thought channel opens with `<|channel>` then the word `thought`, which
# count as two thinking tokens.
BLOCK_TOKENS = {
    ("<think>", "</think>"): ("<think>", "</think>"),
    ("<|channel>thought", "<channel|>"): ("<|channel>", "<channel|>"),
}


@dataclass
class ThinkBudget:
    """One generation's budget: `limit` thinking tokens, then `closing` (token ids) is forced.

    `opener` and `closer` are the think block's marker tokens; `inside` says whether the
    prompt left a block open (templates that prefill the opener)."""

    limit: int
    opener: int
    closer: int
    closing: list[int]
    inside: bool = False
    spent: int = 0  # thinking tokens kept so far
    fired: bool = False
    pending: list[int] = field(default_factory=list)  # closing tokens still to commit

    def cut(self, tokens: list[int]) -> int | None:
        """Read committed tokens in order; where the budget fires, return how many of them
        stay (the next one is replaced by the closing, whose first token is returned by
        `take_first`). None when it does not fire within them."""
        if self.fired:
            return None
        for i, token in enumerate(tokens):
            if self.inside:
                if token == self.closer:
                    self.inside = False
                    continue
                if self.spent >= self.limit:
                    self.fired = True
                    self.pending = list(self.closing)
                    return i
                self.spent += 1
            elif token == self.opener:
                self.inside = True
        return None

    def take_first(self) -> int:
        """The closing's first token, which takes the place of the token cut."""
        return self.pending.pop(0)

    def close(self, tokens: list[int]) -> tuple[list[int], bool]:
        """`tokens` as committed under the budget, and whether it fired within them: up to
        the cut, then the closing's first token in place of the rest (the rest of the
        closing stays `pending` for the next round)."""
        kept = self.cut(tokens)
        if kept is None:
            return tokens, False
        return tokens[:kept] + [self.take_first()], True


def markers_of(tokenizer: Any, markers: tuple[str, str]) -> tuple[int, int] | None:
    """The (opener, closer) ids of a think block's markers (`BLOCK_TOKENS`) where each is one
    token of the tokenizer's vocabulary; None otherwise (the budget cannot count there: a
    channel transcript, or a vocabulary without them)."""
    tokens = BLOCK_TOKENS.get(tuple(markers))
    if tokens is None:
        return None
    vocab = getattr(tokenizer, "get_vocab", None)
    table = vocab() if callable(vocab) else {}
    ids = [table.get(m) for m in tokens]
    if any(i is None for i in ids):
        return None
    return int(ids[0]), int(ids[1])


def make_budget(
    tokenizer: Any,
    limit: int,
    markers: tuple[str, str],
    prompt: list[int],
    message: str = DEFAULT_MESSAGE,
) -> ThinkBudget | None:
    """A budget of `limit` thinking tokens for a model whose think markers are `markers`, or
    None where the tokenizer lacks them as single tokens. It starts inside a think block when
    `prompt` (the ids the model sees) leaves one open. The closing is "\\n\\n{message}\\n"
    then the closer then a blank line, tokenized as the model would read it."""
    if limit < 0:
        raise ValueError(f"a reasoning budget must be >= 0 tokens, got {limit}")
    ids = markers_of(tokenizer, markers)
    if ids is None:
        return None
    opener, closer = ids
    inside = _last(prompt, opener) > _last(prompt, closer)
    head = tokenizer.encode(f"\n\n{message}\n" if message else "\n", add_special_tokens=False)
    tail = tokenizer.encode("\n\n", add_special_tokens=False)
    closing = [*head, closer, *tail]
    return ThinkBudget(limit, opener, closer, closing, inside=inside)


def _last(ids: list[int], token: int) -> int:
    """The last index of `token` in `ids`, -1 when absent."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
