"""Operations routes: /health, /metrics, /rounds and /events, /calibration, /doctor, and the /admin
control plane (load, unload, cancel)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ConfigDict, Field

from ..chat.render import EFFORTS, capabilities
from ..core import cuda_graphs
from ..core.device import on_cuda_gpu
from ..core.hub import looks_like_repo_id
from ..plugins.strategies.lookup_assist import LookupAssist
from .checks import CheckedRequest
from .engine import model_id
from .errors import ApiError
from .loading import LoadSpec
from .memory import guard_report
from .rounds import KEEP, RoundLog
from .warnings import collect as collect_warnings


class LoadRequest(CheckedRequest):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=4096)
    drafter: str | None = Field(default=None, min_length=1, max_length=4096)
    draft_model: str | None = Field(default=None, min_length=1, max_length=4096)  # mode draft
    mode: str = "auto"
    # unset fields of these take the server's flags (Engine.load_settings), not the defaults
    max_draft: int | Literal["auto", "full"] | None = Field(default=None)
    context_window: int | None = Field(default=None, ge=0)  # 0: back to the model's own
    confidence_threshold: float | None = Field(default=None, ge=0, le=1)
    drafter_window: int | None = Field(default=None, ge=0, le=10_000_000)  # 0: every row
    kv_bits: Literal[4, 8] | None = None
    drafter_bits: Literal[4, 8, 16] | None = None
    lookup_drafts: bool | None = None
    lookup_long_draft: int | None = Field(default=None, ge=1, le=256)
    warmup: bool | None = None  # a throwaway generation before serving (default: on a GPU)
    # sticky server defaults for the requests after this load (as `serve --no-thinking` and
    # `--reasoning-effort` set them); unset keeps the current ones
    enable_thinking: bool | None = None
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    reasoning_budget: int | None = Field(default=None, ge=0, le=1 << 30)


class CancelRequest(CheckedRequest):
    model_config = ConfigDict(extra="forbid")

    # delete the stopped download's partial files (else kept for the next try to resume)
    cleanup: bool = False


def check_reference(ref: str, param: str) -> None:
    """A model reference must be what `outrider.core.hub.resolve_model` can load: a local model
    folder (config.json, or LM Studio's one GGUF), a .gguf file, a `gguf:` spec, or a
    well-formed Hugging Face repo id. One message for every other case, so the answer never
    tells whether some path exists on this machine, and long input is not echoed back."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if ref.startswith("gguf:"):
        return  # resolved (or refused, the running model kept) by the load itself
    try:
        path = Path(ref).expanduser()
        if (path / "config.json").is_file():
            _refuse_code(path, param)
            return
        if path.suffix.lower() == ".gguf" and path.is_file():
            return
        if path.is_dir() and any(path.glob("*.gguf")):
            return
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        pass
    if looks_like_repo_id(ref):
        try:
            validate_repo_id(ref)
            return
        except HFValidationError:
            pass
    shown = ref if len(ref) <= 80 else ref[:77] + "..."
    raise ApiError(
        400,
        f"{param} {shown!r} is not a model folder (with config.json) or GGUF on this server, "
        "nor a Hugging Face repo id",
        param=param,
    )


def _refuse_code(path: Path, param: str) -> None:
    """A local folder whose config.json asks to run its own code is a 400 now, before the
    running model is released (the load would refuse it too, later)."""
    from ..core.checkpoint import code_it_runs, read_config
    from ..core.errors import CheckpointError

    try:
        runs = code_it_runs(read_config(path))
    except CheckpointError:
        return  # a damaged config.json: the load says what is wrong with it
    if runs is not None:
        raise ApiError(400, f"{param} is refused: {runs}", param=param)


def _drafting(pipe: Any) -> Any:
    """The pipeline's own proposer, under a LookupAssist wrapper if there is one."""
    return getattr(pipe.proposer, "inner", pipe.proposer) if pipe else None


def confidence_threshold(pipe: Any) -> float | None:
    proposer = _drafting(pipe)
    if not getattr(getattr(proposer, "spec", None), "confidence_head", False):
        return None
    return getattr(proposer, "threshold", None)


def drafter_window(pipe: Any) -> int | None:
    return getattr(_drafting(pipe), "context_window", None)


def health(state: Any) -> dict[str, Any]:
    engine = state.engine
    pipe = engine.pipeline
    out: dict[str, Any] = {
        "status": "ok" if engine.state == "ready" else engine.state,
        "model": model_id(pipe) if pipe else None,
        "mode": pipe.mode if pipe else None,
        "drafter": pipe.drafter_ref if pipe else None,  # registry drafters included
        "max_draft": ("auto" if pipe.auto_cap else pipe.max_draft) if pipe else None,
        # context rows a DSpark / DFlash drafter sees (None: every row, or no block drafter)
        "drafter_window": drafter_window(pipe),
        # DSpark's confidence stop in use (None: no drafter reads one)
        "confidence_threshold": confidence_threshold(pipe),
        # drafter rounds that verify a lookup copy instead, and the longest such copy
        "lookup_drafts": isinstance(pipe.proposer, LookupAssist) if pipe else None,
        "lookup_long_draft": (
            pipe.proposer.max_lookup if pipe and isinstance(pipe.proposer, LookupAssist) else None
        ),
        "load": engine.status(),
        "context_window": engine.context_window,
        "max_output_tokens": state.limits.max_tokens_cap,
        "thinking_default": {None: "template", True: "on", False: "off"}[state.limits.thinking],
        "reasoning_effort_default": state.limits.reasoning_effort,  # None: the template's
        "reasoning_budget_default": state.limits.reasoning_budget,  # None: no budget
        # what fills a request's unset temperature / top_p / top_k ({}: greedy)
        "sampling_defaults": state.limits.sampling_for(engine).as_dict(),
        "queue_depth": engine.metrics.queue_depth(),
        "kv_bits": pipe.target.kv_bits if pipe else None,
        "max_batch": engine.max_batch,
        # whether MLX's CUDA backend records kernels into graphs (serve --cuda-graphs); None
        # off a CUDA GPU, where nothing reads it
        "cuda_graphs": cuda_graphs.state() if on_cuda_gpu() else None,
        "batching": engine.batching,  # max_batch > 1 and a target whose caches batch
        # each condition worth a look: {code, level, message, action} (server/warnings.py)
        "warnings": collect_warnings(engine),
        # memory relief before a generation (serve --no-memory-guard turns it off)
        "memory_guard": guard_report(engine.memory_guard, engine.metrics),
    }
    if pipe is not None:
        caps = capabilities(pipe.tokenizer)
        out["capabilities"] = {
            "chat": True,
            "completions": True,
            "messages": True,
            "streaming": True,
            "logprobs": True,
            "penalties": True,
            **caps,
        }
    return out


def router(state: Any) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    def get_health() -> dict:
        return health(state)

    @r.get("/metrics", response_class=PlainTextResponse)
    def metrics(format: Literal["prometheus", "json"] = "prometheus") -> Any:
        pipe = state.engine.pipeline
        labels = {"model": model_id(pipe), "mode": pipe.mode} if pipe else {}
        if format == "json":  # the same counters as one object
            return JSONResponse(state.engine.metrics.as_dict(labels))
        return state.engine.metrics.render(labels)

    @r.post("/admin/load", status_code=202)
    def load(body: LoadRequest) -> dict:
        mode = body.mode
        if mode != "auto":
            try:
                state.plugins().strategy(mode)
            except Exception as e:
                raise ApiError(400, str(e), param="mode") from None
        # Refused before the running model is released; a load that fails later restores it.
        check_reference(body.model, "model")
        if body.drafter is not None:
            check_reference(body.drafter, "drafter")
        if body.draft_model is not None:
            check_reference(body.draft_model, "draft_model")
        window = body.context_window  # sticky: None keeps the last load's limit
        if window is not None and 0 < window < 16:
            raise ApiError(400, "context_window must be 0 (the model's own) or >= 16")
        if isinstance(body.max_draft, int) and not 0 <= body.max_draft <= 64:
            raise ApiError(400, 'max_draft must be 0..64 or "auto"', param="max_draft")
        spec = LoadSpec(
            body.model,
            body.drafter,
            mode,
            body.max_draft,
            window,
            body.confidence_threshold,
            kv_bits=body.kv_bits,
            draft_model=body.draft_model,
            drafter_window=body.drafter_window,
            lookup_drafts=body.lookup_drafts,
            lookup_long_draft=body.lookup_long_draft,
            warmup=body.warmup,
        )
        if body.drafter_bits is not None:
            spec.drafter_bits = body.drafter_bits
        named = {k for k in body.model_fields_set if getattr(body, k) is not None}
        state.engine.load(state.engine.with_settings(spec, named))
        if body.enable_thinking is not None:
            state.limits.thinking = body.enable_thinking
        if body.reasoning_effort is not None:
            state.limits.reasoning_effort = body.reasoning_effort
        if body.reasoning_budget is not None:
            state.limits.reasoning_budget = body.reasoning_budget
        return health(state)

    @r.post("/admin/load/cancel")
    def cancel(body: CancelRequest | None = None) -> dict:
        cleanup = body is not None and body.cleanup
        cancelled = state.engine.cancel_load(cleanup=cleanup)
        return {"cancelled": cancelled, "cleanup": cancelled and cleanup, **health(state)}

    @r.post("/admin/unload")
    def unload() -> dict:
        state.engine.unload()
        return {"unloading": True}

    @r.get("/admin/status")
    def status() -> dict:
        return state.engine.status()

    @r.get("/calibration")
    def get_calibration() -> dict:
        return calibration_report(state.engine.pipeline)

    @r.get("/rounds")
    def get_rounds(limit: int = Query(128, ge=0, le=KEEP)) -> dict:
        """The engine's last rounds across requests, oldest first, and totals."""
        log = state.engine.rounds
        return {"rounds": log.snapshot(limit), "stats": log.stats()}

    @r.get("/events")
    async def events(request: Request) -> StreamingResponse:
        """Server-sent events: the last rounds (`event: round`), then each round as it runs,
        and the totals (`event: stats`) after the replay and whenever nothing has run for a
        keep-alive interval."""
        return StreamingResponse(
            round_events(state.engine.rounds, request, state.limits.keepalive_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @r.get("/admin/integrations")
    def get_integrations(request: Request) -> dict:
        """Settings that point coding agents at this server (server/integrations.py)."""
        from .integrations import integrations

        base = str(request.base_url).rstrip("/")
        info = health(state)
        if not info["model"]:
            raise ApiError(503, "no model is loaded (POST /admin/load first)")
        return {
            "base_url": base,
            "model": info["model"],
            "integrations": integrations(base, info, keyed=bool(state.api_key)),
        }

    @r.get("/doctor")
    def get_doctor() -> dict:
        from ..doctor import doctor_report

        return doctor_report()  # what `outrider doctor --json` prints

    return r


async def round_events(log: RoundLog, request: Request, idle_s: float) -> AsyncIterator[str]:
    queue, replay = log.subscribe()
    try:
        for event in replay:
            yield sse("round", event)
        yield sse("stats", log.stats())
        while not await request.is_disconnected():
            try:
                kind, event = await asyncio.wait_for(queue.get(), idle_s)
            except asyncio.TimeoutError:
                yield sse("stats", log.stats())
                continue
            yield sse(kind, event)
    finally:
        log.unsubscribe(queue)


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def calibration_report(pipe: Any) -> dict[str, Any]:
    """The loaded pipeline's measured costs (what `--max-draft auto` and the batch scheduler
    read) and what its cap policy believes now; `available` false with the reason when there
    are none."""
    if pipe is None:
        return {"available": False, "reason": "no model is loaded"}
    out: dict[str, Any] = {
        "mode": pipe.mode,
        "max_draft": "auto" if pipe.auto_cap else pipe.max_draft,
    }
    cal = pipe.calibration
    if cal is None:
        reason = (
            f"{pipe.mode} mode drafts nothing"
            if pipe.proposer.max_draft == 0
            else "not calibrated on this machine (outrider calibrate, or --max-draft auto)"
        )
        return {"available": False, "reason": reason, **out}
    policy = pipe.cap_policy.snapshot() if pipe.cap_policy is not None else None
    return {
        "available": True,
        **out,
        "file": str(cal.path) if cal.path else None,
        "padding": {str(n): v for n, v in sorted(cal.widths.items())},
        "calibration": cal.as_dict(),
        "policy": policy,
    }
