"""`outrider serve` and `outrider claude` (registered on the CLI by cli.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import typer

from ..cli_common import LOOKUP_DRAFTS, LOOKUP_LONG_DRAFT, TARGET_ALIAS

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(claude)


def serve(
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: demo)."
    ),
    target_alias: str | None = TARGET_ALIAS,
    drafter: str | None = Opt(None, "--drafter", "-d", help="Drafter folder or repo id."),
    draft_model: str | None = Opt(
        None, "--draft-model", help="A small model with the target's tokenizer (mode draft)."
    ),
    mode: str = Opt(
        "auto",
        "--mode",
        help="auto|dspark|dflash|dflash2|eagle3|draft|lookup|baseline, or a plugin's.",
    ),
    lookup_drafts: bool | None = LOOKUP_DRAFTS,
    lookup_long_draft: int | None = LOOKUP_LONG_DRAFT,
    max_draft_text: str | None = Opt(
        None,
        "--max-draft",
        metavar="N|auto",
        help="Draft cap per round (>= 0); auto (the default once this machine is calibrated: "
        "the first load measures it): measured each round (one request at a time).",
    ),
    confidence_threshold: float | None = Opt(
        None,
        "--confidence-threshold",
        help="DSpark: stop drafting below this confidence, 0..1 (default: the pair's, else 0).",
    ),
    drafter_window: int | None = Opt(
        None,
        "--drafter-window",
        metavar="ROWS",
        help="DSpark/DFlash: the drafter sees the latest ROWS context rows (0: all; default 4096).",
    ),
    drafter_bits: int = Opt(4, "--drafter-bits", help="Drafter weights: 16, 8 or 4 bits."),
    no_model: bool = Opt(False, "--no-model", help="Start empty; load with POST /admin/load."),
    host: str = Opt("127.0.0.1", "--host"),
    port: int = Opt(8080, "--port"),
    api_key: str | None = Opt(
        None, "--api-key", envvar="OUTRIDER_API_KEY", help="Require this key on every route."
    ),
    context_window: int | None = Opt(None, "--context-window", help="Refuse longer prompts."),
    default_max_tokens: int = Opt(2048, "--default-max-tokens"),
    max_tokens_cap: int = Opt(131072, "--max-tokens-cap", help="Refuse larger max_tokens."),
    no_thinking: bool = Opt(False, "--no-thinking", help="Thinking off unless a request asks."),
    reasoning_effort: str | None = Opt(
        None,
        "--reasoning-effort",
        help="Effort for templates that read one, unless a request says (none..xhigh).",
    ),
    reasoning_budget: int | None = Opt(
        None,
        "--reasoning-budget",
        min=0,
        help="Close the model's thinking after this many tokens, unless a request sets a "
        "budget (Anthropic thinking.budget_tokens, or reasoning_budget).",
    ),
    budget_message: str | None = Opt(
        None,
        "--budget-message",
        help="What the closed thinking ends with (default: 'I have to answer now.').",
    ),
    default_temperature: float | None = Opt(
        None,
        "--default-temperature",
        help="Temperature of requests that set none (default: the model's "
        "generation_config.json, else 0: greedy).",
    ),
    default_top_p: float | None = Opt(
        None, "--default-top-p", help="top_p of requests that set none (default: the model's)."
    ),
    default_top_k: int | None = Opt(
        None, "--default-top-k", help="top_k of requests that set none (default: the model's)."
    ),
    keepalive: float = Opt(15.0, "--keepalive", help="Seconds between stream keep-alives."),
    max_request_mb: float = Opt(
        4.0, "--max-request-mb", help="Refuse request bodies larger than this (413)."
    ),
    cors_origin: list[str] | None = Opt(
        None,
        "--cors-origin",
        help="A web origin allowed to call the server from a browser (repeatable; '*': any).",
    ),
    trust_request_chat_template: bool = Opt(
        False,
        "--trust-request-chat-template",
        help="Let requests bring their own chat template (rendered in a sandbox).",
    ),
    log_level: str = Opt(
        "warning", "--log-level", help="debug|info|warning|error; info logs every request."
    ),
    prefix_cache_gb: float = Opt(
        2.0, "--prefix-cache-gb", help="Memory for reusing prompt prefixes (0: off)."
    ),
    prefix_cache_dir: str | None = Opt(
        None, "--prefix-cache-dir", help="Keep prefix caches on disk here too (survive restarts)."
    ),
    no_prefix_cache: bool = Opt(
        False, "--no-prefix-cache", metavar="", help="Reuse no prefixes (--prefix-cache-gb 0)."
    ),
    max_batch: int = Opt(
        1, "--max-batch", help="Decode up to this many requests together (not with --kv-bits)."
    ),
    cuda_graphs: str = Opt(
        "auto",
        "--cuda-graphs",
        metavar="auto|on|off",
        help="MLX's CUDA graphs, on a CUDA GPU: auto turns them off at --max-batch above 1 "
        "(batched rounds run faster without), else leaves MLX's default.",
    ),
    warmup: bool | None = Opt(
        None,
        "--warmup/--no-warmup",
        help="Generate a few throwaway tokens at load, so the first request builds no kernels "
        "(default: on a GPU).",
    ),
    memory_guard: bool = Opt(
        True,
        "--memory-guard/--no-memory-guard",
        help="Past 90% of memory in use, give MLX's buffer cache and then the prefix cache "
        "back before a generation.",
    ),
    no_batch_scheduler: bool = Opt(
        False,
        "--no-batch-scheduler",
        metavar="",
        help="Batched rounds verify every row's cap (no DSpark prefix scheduler).",
    ),
    kv_bits: int | None = Opt(None, "--kv-bits", help="Quantize the KV cache: 8 or 4 bits."),
) -> None:
    """Serve OpenAI- and Anthropic-compatible APIs; speculation is invisible to clients."""
    from ..chat.render import EFFORTS
    from ..cli_common import check_options, one_model, parse_max_draft, plugins, user_errors
    from ..core import cuda_graphs as graphs
    from ..core import generation_config
    from ..core.device import on_cuda_gpu
    from ..core.errors import OutriderError

    with user_errors():
        model = one_model(model, target_alias)
        if no_prefix_cache:
            prefix_cache_gb = 0.0
        max_draft = parse_max_draft(max_draft_text)
        check_options(default_max_tokens, max_draft, drafter_bits, mode)
        if not 0 < port < 65536:
            raise OutriderError(f"--port must be in 1..65535, got {port}")
        if context_window is not None and context_window < 16:
            raise OutriderError(f"--context-window must be >= 16, got {context_window}")
        if keepalive <= 0:
            raise OutriderError(f"--keepalive must be > 0, got {keepalive}")
        if max_batch < 1:
            raise OutriderError(f"--max-batch must be >= 1, got {max_batch}")
        cuda_graphs = cuda_graphs.strip().lower()
        graphs.choose(cuda_graphs, max_batch)  # a wrong value is one line before anything runs
        if kv_bits not in (None, 4, 8):
            raise OutriderError(f"--kv-bits must be 8 or 4, got {kv_bits}")
        if prefix_cache_gb < 0:
            raise OutriderError(f"--prefix-cache-gb must be >= 0, got {prefix_cache_gb}")
        if no_model and model:
            raise OutriderError("--no-model and --model contradict each other")
        if reasoning_effort is not None and reasoning_effort not in EFFORTS:
            raise OutriderError(
                f"--reasoning-effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}"
            )
        if not 0 < max_request_mb <= 1024:
            raise OutriderError(f"--max-request-mb must be in (0, 1024], got {max_request_mb}")
        flags, wrong = generation_config.check(
            default_temperature, default_top_p, default_top_k, "--default-*", "--default-{flag}"
        )
        if wrong:
            raise OutriderError(wrong[0])
        from .jobs import slow_round_seconds

        slow_round_seconds()  # a bad $OUTRIDER_SLOW_ROUND_S is one line now, not a failed request
        level = log_level.lower()
        if level not in LOG_LEVELS:
            raise OutriderError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level}"
            )
        for origin in cors_origin or ():
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise OutriderError(
                    f"--cors-origin takes an origin such as http://localhost:3000, got {origin!r}"
                )
        _configure_logging(level)
        # before the first GPU kernel, which is when MLX reads it (core/cuda_graphs.py)
        chose = graphs.apply(cuda_graphs, max_batch)
        if chose == "off" and cuda_graphs == "auto" and on_cuda_gpu():
            typer.echo(f"note: --max-batch {max_batch}: MLX's CUDA graphs are off, which batched "
                       "rounds run faster without (--cuda-graphs on keeps them)", err=True)  # fmt: skip
        import uvicorn

        from .app import create_app
        from .engine import Engine
        from .generation import Limits
        from .loading import LoadSpec

        # The port first: a busy one is one line now, not an abort after the model loaded.
        sock = _listen(host, port)
        from ..core.prefix_cache import PrefixCache

        store = PrefixCache.from_gb(prefix_cache_gb, prefix_cache_dir) if prefix_cache_gb else None
        settings = dict(
            max_draft=max_draft, confidence_threshold=confidence_threshold,
            drafter_bits=drafter_bits, kv_bits=kv_bits,
            lookup_drafts=lookup_drafts, drafter_window=drafter_window,
            lookup_long_draft=lookup_long_draft, warmup=warmup,
        )  # fmt: skip
        engine = Engine(
            prefix_cache=store,
            max_batch=max_batch,
            batch_scheduler=not no_batch_scheduler,
            memory_guard=memory_guard,
            load_settings=settings,
        ).start()
        limits = Limits(
            default_max_tokens,
            max_tokens_cap,
            keepalive,
            False if no_thinking else None,
            max_body_bytes=int(max_request_mb * (1 << 20)),
            trust_request_chat_template=trust_request_chat_template,
            reasoning_effort=reasoning_effort,
            reasoning_budget=reasoning_budget,
            budget_message=budget_message,
            sampling=flags,
        )
        app = create_app(
            engine, limits, api_key, plugins=plugins, cors_origins=tuple(cors_origin or ())
        )
        if not no_model:
            if model is None:
                model, note = default_model()
                typer.echo(f"note: no --model given; {note}", err=True)
            # the first load takes the server's settings as every hot swap does
            spec = LoadSpec(model, drafter, mode, context_window=context_window,
                            draft_model=draft_model)  # fmt: skip
            _load_with_progress(engine, engine.with_settings(spec, named=set()))
        elif context_window:
            engine.window_limit = context_window
        pipe = engine.pipeline
        note = batching_note(pipe, max_batch)
        if note:
            typer.echo(note, err=True)
        where = f"http://{host}:{port}"
        what = (
            f"model {engine.status()['model']}, mode {pipe.mode}"
            if pipe
            else "no model (POST /admin/load)"
        )
        if pipe is not None:
            typer.echo(sampling_note(limits.sampling_for(engine)), err=True)
        typer.echo(f"outrider serve: listening on {where} ({what})", err=True)
        # Open streams get a few seconds to finish on shutdown, then are cancelled (which
        # cancels their generations at the next round).
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=level,
            access_log=False,  # outrider.access writes one line per request, with tokens
            timeout_graceful_shutdown=2,
        )
        interrupted = False
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises Ctrl-C
            interrupted = True
        finally:
            engine.stop()
            sock.close()
        if interrupted:
            typer.echo("\ninterrupted", err=True)
        _leave(130 if interrupted else 0)


def sampling_note(unset: Any) -> str:
    """How requests that set no sampling are decoded, and on whose word."""
    if not unset.set():
        return "note: requests that set no temperature decode greedily"
    return f"note: requests that set no sampling use {unset.describe()} ({unset.source})"


def batching_note(pipe: Any, max_batch: int) -> str | None:
    """Why `--max-batch` above 1 still serves one request at a time with this pipeline, or
    None: said at start-up, since the flag is otherwise taken without a word."""
    why = None if max_batch < 2 or pipe is None else pipe.target.unbatched_reason
    if why is None:
        return None
    return f"note: --max-batch {max_batch}: requests are served one at a time here ({why})"


def _leave(code: int) -> None:
    """Exit without the interpreter's final teardown: once a request has run on the engine's
    thread, MLX's own threads can abort it ("terminate called without an active exception",
    SIGABRT; ml-explore/mlx#3126). Everything of ours is closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _listen(host: str, port: int):
    """A listening socket on host:port, or one clear error naming what is in the way."""
    import errno
    import socket

    from ..core.errors import OutriderError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OutriderError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = (
            "is in use (another server is listening there)"
            if e.errno == errno.EADDRINUSE
            else e.strerror
        )
        raise OutriderError(f"cannot listen on {host}:{port}: the port {why}") from None
    return sock


def _configure_logging(level: str) -> None:
    """outrider's loggers (the access log among them) to stderr at `level`."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("outrider")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def default_model() -> tuple[str, str]:
    """(model, note) when --model is not given: the demo `outrider generate` uses too."""
    from ..demo import demo_target, pair_dir

    return demo_target(), f"serving the demo pair in {pair_dir()}"


def _load_with_progress(engine, spec) -> None:
    """The engine's load, shown as a spinner with its phase and, while files download, their
    bytes (the same figures /health reports), with the fit check's warning if it has one."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    from ..core.errors import OutriderError

    engine.load(spec)
    warned = None
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True, console=_stderr()) as progress:
        task = progress.add_task(f"loading {spec.model}", total=None)
        while engine.state == "loading":
            download = engine.download or {}
            total = download.get("bytes_total") or None
            phase = engine.phase or "queued"
            progress.update(
                task,
                description=f"loading {spec.model} ({phase})",
                completed=download.get("bytes_done", 0) if total else 0,
                total=total,
            )
            if engine.warning and engine.warning != warned:
                warned = engine.warning
                progress.console.print(f"warning: {warned}")
            time.sleep(0.1)
    if engine.state != "ready":
        raise OutriderError(engine.error or f"could not load {spec.model}")


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def claude(
    ctx: typer.Context,
    url: str = Opt("http://127.0.0.1:8080", "--url", help="The outrider server."),
    api_key: str | None = Opt(None, "--api-key", envvar="OUTRIDER_API_KEY"),
    print_env: bool = Opt(False, "--print-env", help="Print shell exports instead of launching."),
    print_settings: bool = Opt(
        False,
        "--print-settings",
        help="Print a .claude/settings.local.json env block instead of launching.",
    ),
) -> None:
    """Launch Claude Code against a running `outrider serve` (arguments after -- go to it)."""
    from ..cli_common import user_errors
    from ..core.errors import OutriderError
    from .claude import claude_env, probe, settings_block, shell_exports

    with user_errors():
        if print_env and print_settings:
            raise OutriderError("--print-env and --print-settings: pass one of them")
        health = probe(url, api_key)
        env = claude_env(dict(os.environ), url, api_key, health)
        if print_env:
            typer.echo(shell_exports(env, dict(os.environ)))
            return
        if print_settings:
            typer.echo(settings_block(env, dict(os.environ)))
            return
        exe = shutil.which("claude")
        if exe is None:
            raise OutriderError(
                "Claude Code (`claude`) is not on PATH; install it, or use --print-env"
            )
        sys.stdout.flush()
        os.execve(exe, [exe, *ctx.args], env)
