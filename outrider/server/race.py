"""`POST /admin/race`: the same prompt through plain decoding and the loaded speculative mode,
one arm after the other on the engine thread (greedy both), streamed as server-sent events so
the page can show the two texts side by side and the speed-up as it happens. `caps` races 2 to
4 arms of the loaded pipeline at caps of their own instead (0: plain decoding; "auto": each
round's cap measured), each compared with the first; `arms` races 2 to 4 modes over the loaded
target (`baseline`, `lookup` and the loaded mode, each at its own cap or one given), the
others built for the race on the target already in memory.

The plain arm is the loaded pipeline with `max_draft=0`: nothing is drafted, so the loop takes
baseline's pipelined plain path (one target forward a token, the drafter idle), exactly what
`--mode baseline` runs; the speculative arm is the pipeline as loaded. Arms queue
through the engine like any request, so there is still one MLX thread. Token times are measured
from each arm's first token, so queueing and prefill (the same prompt in both arms) do not
count: the race compares decoding. Events:

    start     {model, mode, max_draft, prompt_tokens, max_tokens, arms}
    arm_start {arm: "plain" | "spec" (with caps: "plain" | "cap N" | "auto"; with arms: the
               mode, then " cap N" or " auto" and " confidence C" where given), mode,
               max_draft}
    token     {arm, index (tokens so far), text, t_ms, round?: {drafted, accepted}}
    arm_done  {arm, tokens, seconds, prefill_seconds, tokens_per_sec, accept_len, rounds,
               finish_reason}
    verdict   {identical, first_difference, speedup, arms: [{arm, identical, first_difference,
               speedup}]}: each arm against the first; `identical` says all agree, the
               other top-level fields are the last arm's (the default arms: spec against plain)
    done      {}
    error     {message}
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, field_validator, model_validator

from ..chat.render import EFFORTS, render_chat
from .checks import CheckedRequest
from .engine import Job, model_id
from .errors import ApiError
from .generation import (
    GenParams,
    check_context,
    failure,
    options,
    prompt_ids,
    ready_pipeline,
    sse_event,
)
from .generation import submit as submit_job

DEFAULT_MAX_TOKENS = 256
OTHER_MODES = ("baseline", "lookup")  # modes a race builds over the loaded target


class RaceArm(CheckedRequest):
    """One arm of `arms`: a mode, and optionally its cap (0..64, or "auto" for the loaded
    mode, the one whose costs are calibrated) and, for a loaded drafter with a confidence head
    (DSpark's), the cumulative-confidence threshold its drafts are cut at (0..1)."""

    model_config = ConfigDict(extra="forbid")

    mode: str = Field(min_length=1, max_length=64)
    cap: int | Literal["auto"] | None = None
    confidence: float | None = Field(default=None, ge=0.0, le=1.0)

    @field_validator("cap")
    @classmethod
    def _cap_range(cls, cap: int | str | None) -> int | str | None:
        if isinstance(cap, int) and not 0 <= cap <= 64:
            raise ValueError('a cap must be 0..64 or "auto"')
        return cap

    @property
    def name(self) -> str:
        name = self.mode
        if self.cap is not None:
            name += " auto" if self.cap == "auto" else f" cap {self.cap}"
        if self.confidence is not None:
            name += f" confidence {self.confidence:g}"
        return name


class RaceRequest(CheckedRequest):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=200_000)
    system: str | None = Field(default=None, max_length=200_000)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    enable_thinking: bool | None = None
    thinking: bool | None = None  # the reference project's name for enable_thinking
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    # 2 to 4 arms of the loaded pipeline at these caps (0: plain decoding; "auto": measured)
    caps: list[int | Literal["auto"]] | None = Field(default=None, min_length=2, max_length=4)
    # or 2 to 4 modes over the loaded target: "baseline", {"mode": "lookup", "cap": 4}, ...
    arms: list[str | RaceArm] | None = Field(default=None, min_length=2, max_length=4)

    @field_validator("arms")
    @classmethod
    def _distinct_arms(cls, arms: list | None) -> list[RaceArm] | None:
        if arms is None:
            return None
        arms = [RaceArm(mode=a) if isinstance(a, str) else a for a in arms]
        for arm in arms:
            if arm.mode == "baseline" and arm.cap not in (None, 0):
                raise ValueError("a baseline arm drafts nothing: it takes no cap")
        if len({a.name for a in arms}) < len(arms):
            raise ValueError("arms names an arm twice")
        return arms

    @model_validator(mode="after")
    def _one_way(self) -> RaceRequest:
        if self.caps is not None and self.arms is not None:
            raise ValueError("give caps or arms, not both")
        return self

    @field_validator("caps")
    @classmethod
    def _distinct(cls, caps: list | None) -> list | None:
        if caps is not None:
            if any(isinstance(c, int) and not 0 <= c <= 64 for c in caps):
                raise ValueError('each cap must be 0..64 or "auto"')
            if len(set(map(str, caps))) < len(caps):
                raise ValueError("caps names an arm twice")
        return caps


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token index where two outputs differ (None when they are identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(reference: list[int], other: list[int], tokenizer: Any) -> dict[str, Any]:
    """Where `other` leaves `reference`: the index, whether one merely stops earlier
    (`length_only`: it ended, by a stop or the limit, where the other went on), and each
    side's token there (id and text; None past its end), so a reader can tell a real
    divergence from one output running longer."""
    at = first_difference(reference, other)
    if at is None:
        return {"first_difference": None}

    def token(tokens: list[int]) -> dict[str, Any] | None:
        if at >= len(tokens):
            return None
        return {"id": tokens[at], "text": tokenizer.decode([tokens[at]])}

    return {
        "first_difference": at,
        "length_only": at == min(len(reference), len(other)),
        "reference_token": token(reference),
        "arm_token": token(other),
    }


MARGIN_TOP = 8  # alternatives a margin probe reads back


def margin_of(top: list[tuple[int, float]], token: int) -> dict[str, Any]:
    """From the target's top alternatives at a divergence (id, log-probability, best first),
    how far the best one leads `token` (in log-probability; `at_least` where `token` is not
    among them, the lead over the last one read), and whether `token` is the runner-up."""
    best = top[0][1]
    ranks = [t for t, _ in top]
    if token in ranks:
        lead = best - top[ranks.index(token)][1]
        return {"margin": round(lead, 6), "runner_up": ranks.index(token) == 1}
    return {"margin": round(best - top[-1][1], 6), "at_least": True, "runner_up": False}


async def _margin(state: Any, prompt: list[int], opts: dict[str, Any], token: int) -> dict:
    """The target's preference where two arms part: one plain step from a fresh prefill of
    `prompt` (the race's prompt and the tokens both arms agree on), its top alternatives read
    back. `approximate`: the arms computed those positions round by round, the probe in one
    prefill, so a lead near 0 is the tie a lossless engine may break either way."""
    probe = {**opts, "max_tokens": 1, "max_draft": 0, "logprobs": MARGIN_TOP}
    probe.pop("snapshot_at", None)
    job: Job = submit_job(state.engine, prompt, probe)
    top: list[tuple[int, float]] = []
    while True:
        kind, value = await job.events.get()
        if kind == "error":
            return {}
        if kind == "end":
            break
        if value.step.logprobs:
            top = value.step.logprobs[0].top
    return {**margin_of(top, token), "approximate": True} if top else {}


async def _arm(
    state: Any,
    arm: str,
    prompt: list[int],
    opts: dict[str, Any],
    out: dict[str, Any],
    pipeline: Any = None,
) -> AsyncIterator[str]:
    """Run one arm to its end (through `pipeline` over the loaded target, when given),
    yielding its SSE frames; its Result lands in `out["result"]`."""
    job: Job = submit_job(state.engine, prompt, opts, pipeline=pipeline)
    first: float | None = None
    index = 0
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), state.limits.keepalive_s)
            except asyncio.TimeoutError:
                yield ": keepalive\n\n"
                continue
            if kind == "error":
                raise ApiError(500, failure(value), "server_error")
            if kind == "end":
                out["result"] = value
                return
            now = time.perf_counter()
            first = now if first is None else first
            index += len(value.tokens)
            data: dict[str, Any] = {
                "arm": arm,
                "index": index,
                "text": value.text,
                "t_ms": round((now - first) * 1000, 3),
            }
            if value.step.source == "draft":
                data["round"] = {
                    "drafted": len(value.step.drafted),
                    "accepted": value.step.accepted,
                }
            yield sse_event("token", data)
    finally:
        job.cancel.set()  # a client that leaves stops the arm at its next round


def _summary(arm: str, result: Any) -> dict[str, Any]:
    return {
        "arm": arm,
        "tokens": len(result.tokens),
        "seconds": round(result.decode_seconds, 6),
        "prefill_seconds": round(result.prefill_seconds, 6),
        "tokens_per_sec": round(result.decode_tps, 2),
        "accept_len": round(result.mean_accept_len, 4),
        "rounds": len(result.rounds),
        "finish_reason": result.finish_reason,
    }


def arm_list(
    pipe: Any,
    opts: dict[str, Any],
    caps: list | None,
    arms: list[RaceArm] | None = None,
    plugins: Any = None,
) -> list[tuple]:
    """(name, stream options, cap, pipeline or None for the loaded one) of each arm: plain
    against the pipeline as loaded, one arm a cap (0: plain decoding, "auto": each round's
    cap measured), or one arm a mode over the loaded target (`arms`)."""
    if arms is not None:
        return [_mode_arm(pipe, opts, arm, plugins) for arm in arms]
    if caps is None:
        return [("plain", {**opts, "max_draft": 0}, 0, None), ("spec", opts, pipe.max_draft, None)]
    names = {0: "plain", "auto": "auto"}
    return [(names.get(c, f"cap {c}"), {**opts, "max_draft": c}, c, None) for c in caps]


def _mode_arm(pipe: Any, opts: dict[str, Any], arm: RaceArm, plugins: Any) -> tuple:
    """An arm of `arm.mode`: the loaded pipeline for its own mode, else a pipeline of that
    mode built now over the loaded target (baseline or lookup: no weights of their own)."""
    if arm.confidence is not None:
        own = confident_pipeline(pipe, arm)
    elif arm.mode == pipe.mode:
        own = None
    elif arm.mode in OTHER_MODES:
        if arm.cap == "auto":
            raise ApiError(
                400, f'only the loaded mode ({pipe.mode}) races at cap "auto"', param="arms"
            )
        own = mode_pipeline(pipe, arm.mode, plugins)
    else:
        modes = ", ".join(dict.fromkeys((*OTHER_MODES, pipe.mode)))
        raise ApiError(
            400, f"a race arm's mode must be one of {modes} (the loaded target's), got "
            f"{arm.mode!r}", param="arms",
        )  # fmt: skip
    if arm.cap is None and arm.mode == pipe.mode:  # as the loaded mode runs a request
        return arm.name, opts, pipe.max_draft, own
    runs = own if own is not None else pipe
    cap = runs.max_draft if arm.cap is None else arm.cap
    if isinstance(cap, int):
        cap = min(cap, runs.proposer.max_draft)
    return arm.name, {**opts, "max_draft": cap}, cap, own


def confident_pipeline(pipe: Any, arm: RaceArm) -> Any:
    """The loaded pipeline with its drafter at the arm's confidence threshold: the same
    drafter, target, calibration and prefix cache."""
    from ..api import pipeline_from_parts

    spec = getattr(pipe.proposer, "spec", None)
    if arm.mode != pipe.mode or not getattr(spec, "confidence_head", False):
        raise ApiError(
            400, f"confidence applies to the loaded drafter's own arm, and {pipe.mode}'s "
            f"drafter here has no confidence head (DSpark's has); got it for {arm.mode!r}",
            param="arms",
        )  # fmt: skip
    proposer = pipe.proposer.with_threshold(arm.confidence)
    built = pipeline_from_parts(pipe.target, proposer, pipe.mode, pipe.max_draft)
    built.calibration, built.auto_cap = pipe.calibration, pipe.auto_cap
    built.cap_given, built.prefix_cache = pipe.cap_given, pipe.prefix_cache
    return built


def mode_pipeline(pipe: Any, mode: str, plugins: Any = None) -> Any:
    """A pipeline of `mode` over `pipe`'s target, at the strategy's own cap, sharing its
    prefix cache: what `--mode {mode}` runs, without loading the target again."""
    from ..api import pipeline_from_parts
    from ..core.plugins import Plugins

    strategy = (plugins or Plugins()).strategy(mode)
    proposer = strategy.build(pipe.target, None, {})
    built = pipeline_from_parts(pipe.target, proposer, mode, strategy.default_cap)
    built.prefix_cache = pipe.prefix_cache
    return built


async def race_events(
    state: Any, pipe: Any, prompt: list[int], opts: dict[str, Any], arms: list[tuple]
) -> AsyncIterator[str]:
    """The race's frames: each arm (`arm_list`) in turn, then whether their tokens agree."""
    yield sse_event(
        "start",
        {
            "model": model_id(pipe),
            "mode": pipe.mode,
            "max_draft": pipe.max_draft,
            "prompt_tokens": len(prompt),
            "max_tokens": opts["max_tokens"],
            "arms": [name for name, *_ in arms],
        },
    )
    results: dict[str, Any] = {}
    try:
        for arm, arm_opts, cap, own in arms:
            if state.engine.pipeline is not pipe:
                raise ApiError(409, "the model changed during the race; run it again")
            mode = (own or pipe).mode
            yield sse_event("arm_start", {"arm": arm, "mode": mode, "max_draft": cap})
            out: dict[str, Any] = {}
            async for frame in _arm(state, arm, prompt, arm_opts, out, own):
                yield frame
            if out.get("result") is None:
                return  # cancelled: the client or the server went away
            results[arm] = out["result"]
            yield sse_event("arm_done", _summary(arm, out["result"]))
    except ApiError as e:
        yield sse_event("error", {"message": e.message})
        return
    first = results[arms[0][0]]
    against = []
    for name, *_ in arms[1:]:
        result = results[name]
        where = divergence(first.tokens, result.tokens, pipe.tokenizer)
        at = where["first_difference"]
        if at is not None and not where["length_only"] and state.engine.pipeline is pipe:
            stem = prompt + first.tokens[:at]
            where.update(await _margin(state, stem, arms[0][1], result.tokens[at]))
        speedup = result.decode_tps / first.decode_tps if first.decode_tps > 0 else None
        against.append({
            "arm": name,
            "identical": where["first_difference"] is None,
            **where,
            "speedup": round(speedup, 3) if speedup is not None else None,
        })  # fmt: skip
    verdict = {k: v for k, v in against[-1].items() if k != "arm"}
    verdict["identical"] = all(a["identical"] for a in against)
    yield sse_event("verdict", {**verdict, "arms": against})
    yield sse_event("done", {})


def router(state: Any) -> APIRouter:
    r = APIRouter()

    events = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}

    @r.post("/admin/race", response_class=StreamingResponse, responses={200: events})
    async def race(body: RaceRequest) -> StreamingResponse:
        engine = state.engine
        pipe = ready_pipeline(engine)
        messages = [{"role": "user", "content": body.prompt}]
        if body.system:
            messages.insert(0, {"role": "system", "content": body.system})
        given = {body.enable_thinking, body.thinking} - {None}
        if len(given) > 1:
            raise ApiError(400, "thinking and enable_thinking disagree: give one", param="thinking")
        thinking = given.pop() if given else state.limits.thinking
        prompt, *_ = await prompt_ids(
            engine, False, render_chat, pipe.tokenizer, messages, None, thinking,
            body.reasoning_effort or state.limits.reasoning_effort,
        )  # fmt: skip
        check_context(engine, len(prompt), anthropic=False)
        opts = options(
            engine,
            state.limits,
            len(prompt),
            GenParams(max_tokens=body.max_tokens, temperature=0.0),
        )
        plugins = state.plugins() if callable(getattr(state, "plugins", None)) else None
        arms = arm_list(pipe, opts, body.caps, body.arms, plugins)  # a wrong mode: 400 here
        stream = race_events(state, pipe, prompt, opts, arms)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    return r
