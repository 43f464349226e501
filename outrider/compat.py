"""mlx-dspark's Python API over outrider, so scripts written for it run unchanged.

The reference project (github.com/ARahim3/mlx-dspark) documents::

    target, tok, drafter, cfg = load_pair("mlx-community/Qwen3-8B-8bit")
    res = speculative_generate(target, tok, drafter, "Explain how rainbows form.")
    print(res.text, res.mean_accept_len, res.tokens_per_sec)

These are thin adapters: `load_pair` is `outrider.load(..., mode="dspark")` and the generate
calls stream one `Pipeline`; there is no second decode loop, so the output is outrider's (equal
to the target's own). Knobs that only tune speed in the reference are accepted and left to
outrider; knobs that carry the reference's own cache objects are refused by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .api import Pipeline, load
from .core.errors import OutriderError
from .core.events import Result
from .core.logits import Penalties
from .core.target import Target
from .prompts import encode_messages as _encode_messages
from .prompts import encode_prompt as _encode_prompt
from .registry import load_pairs

# The reference's legacy short names, mapped to the registry row of the same model.
LEGACY_ALIASES = {"gemma4": "gemma-4-12b", "qwen3": "qwen3-4b"}
# Reference keywords that only change speed: accepted, outrider chooses its own.
SPEED_ONLY = (
    "cap_controller", "lookup_drafts", "lookup_max_draft", "lookup_long_draft", "ngram_min",
    "ngram_max",
)  # fmt: skip
# Reference keywords that hand over the reference's own state objects: no outrider equivalent.
REFUSED = {
    "cache": "Pipeline.enable_prefix_cache",
    "ctx_caches": "Pipeline.enable_prefix_cache",
    "reuse_len": "Pipeline.enable_prefix_cache",
    "on_prefill": "Pipeline.stream(prefill_progress=...)",
    "prefill_marks": "Pipeline.enable_prefix_cache",
    "on_prefill_progress": "Pipeline.stream(prefill_progress=...)",
    "on_round": "Pipeline.stream (each Chunk.step is one round)",
}
# The reference's reasoning-budget keywords, as Pipeline.stream's (core/think_budget.py).
BUDGET = {"think_budget": "reasoning_budget", "budget_message": "budget_message"}


class StopStreaming(Exception):
    """Raise from `on_text` to end generation early (the reference's name)."""


@dataclass
class Drafter:
    """The drafter handle `load_pair` returns: the loaded pipeline it drafts for.

    Pipelines at other confidence thresholds are built on first use over the same target.
    """

    pipeline: Pipeline
    _by_threshold: dict[float, Pipeline] = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> str:
        return self.pipeline.mode

    def at_threshold(self, threshold: float) -> Pipeline:
        """The pipeline whose DSpark confidence stop is `threshold` (0 = off)."""
        pipe = self.pipeline
        if pipe.options.get("confidence_threshold", 0.0) == threshold:
            return pipe
        if threshold not in self._by_threshold:
            self._by_threshold[threshold] = load(
                pipe.target.name,
                pipe.drafter_ref,
                pipe.mode,
                confidence_threshold=threshold,
                drafter_bits=pipe.options.get("drafter_bits", 4),
                target=pipe.target,
            )
        return self._by_threshold[threshold]


@dataclass
class GenResult:
    """The reference's result fields, filled from one outrider run (`result` keeps it whole).

    `mean_accept_len` is outrider's: tokens committed per target forward, averaged over the
    drafting rounds (accepted drafts + 1); `tokens_per_sec` runs end to end, prefill included.
    """

    text: str
    token_ids: list[int]
    num_tokens: int
    num_rounds: int
    accept_lengths: list[int]
    target_forwards: int
    seconds: float
    finish_reason: str
    lookup_rounds: int = 0
    logprobs: list[dict] | None = None
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0
    result: Result | None = field(default=None, repr=False)
    budget_forced: bool = False  # a reasoning budget (think_budget=) closed the thinking

    @property
    def mean_accept_len(self) -> float:
        if self.result is not None:
            return self.result.mean_accept_len
        if not self.accept_lengths:
            return 1.0 if self.num_tokens else 0.0
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def tokens_per_sec(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.prefill_seconds, 0.0)

    @property
    def decode_tokens_per_sec(self) -> float:
        # The first token comes from the prefill, as in outrider's Result.decode_tps.
        n = max(self.num_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


def _model_ref(model: str) -> str:
    """A legacy alias ("gemma4", "qwen3") becomes its registry row's target; else as given."""
    row_id = LEGACY_ALIASES.get(model)
    if row_id is None:
        return model
    for pair in load_pairs():
        if pair.id == row_id:
            return pair.target
    return model


def _load(model: str, drafter: str | None, mode: str) -> tuple[Any, Any, Drafter, Any]:
    pipe = load(_model_ref(model), drafter, mode, confidence_threshold=0.0)
    return pipe.target, pipe.tokenizer, Drafter(pipe), pipe.drafter


def load_pair(
    model: str = "gemma4", *, drafter: str | None = None
) -> tuple[Any, Any, Drafter, Any]:
    """(target, tokenizer, drafter, config) for a DSpark pair, as mlx-dspark's `load_pair`.

    The drafter resolves from outrider's registry unless given; `config` is the drafter's
    translated spec. The confidence stop starts off (0.0), the reference's library default.
    """
    return _load(model, drafter, "dspark")


def load_dflash_pair(
    model: str = "gemma4", *, drafter: str | None = None
) -> tuple[Any, Any, Drafter, Any]:
    """(target, tokenizer, drafter, config) for a DFlash pair, the drafter already bound."""
    return _load(model, drafter, "dflash")


def load_target(
    repo_or_path: str = "gemma4",
    *,
    require_tap: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> tuple[Target, Any]:
    """(target, tokenizer), as mlx-dspark's `load_target`: for `greedy_generate` and
    `lookup_generate`. `require_tap` is accepted (outrider probes the layers a drafter reads
    when it loads one); the KV cache quantizes in groups of 64 only."""
    if kv_group_size != 64:
        raise OutriderError(f"kv_group_size must be 64 (mlx-lm's), got {kv_group_size}")
    pipe = load(_model_ref(repo_or_path), mode="baseline", kv_bits=kv_bits)
    return pipe.target, pipe.tokenizer


def _over(target: Any, mode: str, **options: Any) -> Pipeline:
    """A drafter-free pipeline over a target already loaded (nothing loads again)."""
    if not isinstance(target, Target):
        raise OutriderError(
            f"target must come from outrider.compat.load_target or load_pair, got "
            f"{type(target).__name__}"
        )
    return load(target.name, mode=mode, target=target, **options)


def encode_messages(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """A conversation's ids through the chat template, as mlx-dspark's `encode_messages`
    (outrider always adds the generation prompt: the ids start an answer)."""
    if not add_generation_prompt:
        raise OutriderError("add_generation_prompt=False is not supported: the ids start an answer")
    return _encode_messages(tokenizer, messages, **template_kwargs)


def encode_prompt(tokenizer: Any, prompt: str, use_chat: bool = True) -> list[int]:
    """One user turn's ids (chat-templated unless `use_chat` is off), as mlx-dspark's."""
    return _encode_prompt(tokenizer, prompt, raw=not use_chat)


def _check_parts(target: Any, drafter: Any, kind: str) -> Pipeline:
    if not isinstance(drafter, Drafter):
        raise OutriderError(
            f"drafter must come from outrider.compat.load_pair/load_dflash_pair, got "
            f"{type(drafter).__name__}"
        )
    if drafter.pipeline.target is not target:
        raise OutriderError("this drafter was loaded with another target: load them as a pair")
    if drafter.kind != kind:
        raise OutriderError(
            f"this is a {drafter.kind} pair; use "
            + ("dflash_generate" if drafter.kind == "dflash" else "speculative_generate")
        )
    return drafter.pipeline


def _check_kwargs(extra: dict[str, Any]) -> dict[str, Any]:
    """Refuse what outrider cannot take; returns the reasoning-budget keywords, renamed."""
    for name in extra:
        if name in SPEED_ONLY or name in BUDGET:
            continue
        if name in REFUSED:
            raise TypeError(f"{name}= has no outrider equivalent here; use {REFUSED[name]}")
        raise TypeError(f"unexpected keyword argument {name!r}")
    return {BUDGET[k]: v for k, v in extra.items() if k in BUDGET and v is not None}


def _run(
    pipe: Pipeline,
    prompt: str,
    prompt_ids: Sequence[int] | None,
    cap: int | None,
    on_text: Callable[[str], Any] | None,
    **kwargs: Any,
) -> GenResult:
    """Stream one pipeline and gather the reference's result fields."""
    full = pipe.proposer.max_draft
    max_draft = full if cap is None or cap <= 0 else min(cap, full)
    source = list(prompt_ids) if prompt_ids is not None else prompt
    tokens: list[int] = []
    text: list[str] = []
    accept_lengths: list[int] = []
    logprobs: list[dict] = []
    forwards = 0
    prefill_seconds = 0.0
    finish = "stop"
    result = None
    start = time.perf_counter()
    chunks = pipe.stream(source, max_draft=max_draft, **kwargs)
    try:
        for chunk in chunks:
            step = chunk.step
            forwards += 1
            if step.source == "prefill":
                prefill_seconds = time.perf_counter() - start
            elif step.source == "draft":
                accept_lengths.append(len(step.committed))
            tokens.extend(chunk.tokens)
            text.append(chunk.text)
            for lp in step.logprobs or ():
                logprobs.append({"token_id": lp.token, "logprob": lp.logprob, "top": lp.top})
            result = chunk.result or result
            if chunk.text and on_text is not None:
                on_text(chunk.text)
    except StopStreaming:
        chunks.close()  # ends after the current round, as the reference's early stop does
    seconds = time.perf_counter() - start
    if result is not None:
        finish = result.finish_reason
    n_rounds = len(accept_lengths)
    return GenResult(
        text=result.text if result is not None else "".join(text),
        token_ids=tokens,
        num_tokens=len(tokens),
        num_rounds=n_rounds,
        accept_lengths=accept_lengths,
        target_forwards=forwards,
        seconds=seconds,
        finish_reason=finish,
        lookup_rounds=n_rounds if pipe.mode == "lookup" else 0,
        logprobs=logprobs if kwargs.get("logprobs") else None,
        prefill_seconds=prefill_seconds,
        prompt_tokens=len(result.prompt_tokens) if result is not None else 0,
        result=result,
        budget_forced=result is not None and result.budget_forced,
    )


def _penalties(presence: float, frequency: float) -> Penalties | None:
    """The reference's penalty keywords as outrider's processors (None when both are 0)."""
    return Penalties(presence, frequency) if presence or frequency else None


def _sampling(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    apply_chat_template: bool,
    stop: Sequence[str] | None,
) -> dict[str, Any]:
    return dict(
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        raw=not apply_chat_template,
        stop=tuple(stop or ()),
    )


def speculative_generate(
    target: Any,
    tokenizer: Any,
    drafter: Drafter,
    prompt: str = "",
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    apply_chat_template: bool = True,
    stop: Sequence[str] | None = None,
    on_text: Callable[[str], Any] | None = None,
    confidence_threshold: float = 0.0,
    max_draft_tokens: int | None = 2,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logprobs: int | None = None,
    verbose: bool = False,
    **reference_only: Any,
) -> GenResult:
    """DSpark generation, as mlx-dspark's `speculative_generate` (cap 2 by default, as there;
    `max_draft_tokens=None` or <= 0 drafts the full block). `verbose` prints one summary line."""
    budget = _check_kwargs(reference_only)
    _check_parts(target, drafter, "dspark")
    pipe = drafter.at_threshold(confidence_threshold)
    penalties = _penalties(presence_penalty, frequency_penalty)
    res = _run(
        pipe,
        prompt,
        prompt_ids,
        max_draft_tokens,
        on_text,
        penalties=penalties,
        logprobs=logprobs,
        **_sampling(max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template, stop),
        **budget,
    )
    if verbose:
        print(
            f"{res.num_tokens} tokens, {res.tokens_per_sec:.1f} tok/s, "
            f"accept {res.mean_accept_len:.2f}, {res.num_rounds} rounds"
        )
    return res


def dflash_generate(
    target: Any,
    tokenizer: Any,
    drafter: Drafter,
    prompt: str = "",
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    apply_chat_template: bool = True,
    stop: Sequence[str] | None = None,
    on_text: Callable[[str], Any] | None = None,
    max_draft_tokens: int | None = None,
    **reference_only: Any,
) -> GenResult:
    """DFlash generation, as mlx-dspark's `dflash_generate` (full block by default)."""
    budget = _check_kwargs(reference_only)
    pipe = _check_parts(target, drafter, "dflash")
    return _run(
        pipe,
        prompt,
        prompt_ids,
        max_draft_tokens,
        on_text,
        **_sampling(max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template, stop),
        **budget,
    )


def greedy_generate(
    target: Any,
    tokenizer: Any,
    prompt: str = "",
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    apply_chat_template: bool = True,
    stop: Sequence[str] | None = None,
    on_text: Callable[[str], Any] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logprobs: int | None = None,
    **reference_only: Any,
) -> GenResult:
    """Plain decoding of the target, as mlx-dspark's `greedy_generate` (outrider's baseline)."""
    budget = _check_kwargs(reference_only)
    penalties = _penalties(presence_penalty, frequency_penalty)
    return _run(
        _over(target, "baseline"),
        prompt,
        prompt_ids,
        None,
        on_text,
        penalties=penalties,
        logprobs=logprobs,
        **_sampling(max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template, stop),
        **budget,
    )


def lookup_generate(
    target: Any,
    tokenizer: Any,
    prompt: str = "",
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    apply_chat_template: bool = True,
    stop: Sequence[str] | None = None,
    on_text: Callable[[str], Any] | None = None,
    max_draft_tokens: int = 6,
    long_draft_tokens: int = 32,
    **reference_only: Any,
) -> GenResult:
    """Drafter-free n-gram lookup, as mlx-dspark's `lookup_generate`: `max_draft_tokens` a
    round, up to `long_draft_tokens` (`--lookup-long-draft`) the widest (`ngram_min` /
    `ngram_max` are accepted; outrider matches 1- to 4-grams)."""
    budget = _check_kwargs(reference_only)
    pipe = _over(target, "lookup", lookup_long_draft=long_draft_tokens)
    return _run(
        pipe,
        prompt,
        prompt_ids,
        max_draft_tokens,
        on_text,
        **_sampling(max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template, stop),
        **budget,
    )
