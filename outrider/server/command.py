"""`outrider serve` and `outrider claude` (registered on the CLI by cli.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(claude)


def serve(
    model: str | None = Opt(
        None, "--model", "-m", help="Target folder or repo id (default: demo)."
    ),
    drafter: str | None = Opt(None, "--drafter", "-d", help="Drafter folder or repo id."),
    mode: str = Opt("auto", "--mode", help="auto|dspark|dflash|lookup|baseline, or a plugin's."),
    max_draft: int | None = Opt(None, "--max-draft", help="Draft cap per round (>= 0)."),
    confidence_threshold: float | None = Opt(None, "--confidence-threshold"),
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
    keepalive: float = Opt(15.0, "--keepalive", help="Seconds between stream keep-alives."),
) -> None:
    """Serve OpenAI- and Anthropic-compatible APIs; speculation is invisible to clients."""
    from ..cli import check_options, plugins, user_errors
    from ..core.errors import OutriderError

    with user_errors():
        check_options(default_max_tokens, max_draft, drafter_bits, mode)
        if not 0 < port < 65536:
            raise OutriderError(f"--port must be in 1..65535, got {port}")
        if context_window is not None and context_window < 16:
            raise OutriderError(f"--context-window must be >= 16, got {context_window}")
        if keepalive <= 0:
            raise OutriderError(f"--keepalive must be > 0, got {keepalive}")
        if no_model and model:
            raise OutriderError("--no-model and --model contradict each other")
        import uvicorn

        from .app import create_app
        from .engine import Engine, LoadSpec
        from .generation import Limits

        engine = Engine().start()
        limits = Limits(
            default_max_tokens, max_tokens_cap, keepalive, False if no_thinking else None
        )
        app = create_app(engine, limits, api_key, plugins=plugins)
        if not no_model:
            if model is None:
                model, note = default_model()
                typer.echo(f"note: no --model given; {note}", err=True)
            spec = LoadSpec(
                model, drafter, mode, max_draft, context_window, confidence_threshold, drafter_bits
            )
            _load_with_progress(engine, spec)
        elif context_window:
            engine.window_limit = context_window
        pipe = engine.pipeline
        where = f"http://{host}:{port}"
        what = (
            f"model {engine.status()['model']}, mode {pipe.mode}"
            if pipe
            else "no model (POST /admin/load)"
        )
        typer.echo(f"outrider serve: listening on {where} ({what})", err=True)
        # Open streams get a few seconds to finish on shutdown, then are cancelled (which
        # cancels their generations at the next round).
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2
        )
        try:
            uvicorn.Server(config).run()
        finally:
            engine.stop()


def default_model() -> tuple[str, str]:
    """(model, note) when --model is not given: the demo `outrider generate` uses too."""
    from ..demo import demo_target, pair_dir

    return demo_target(), f"serving the demo pair in {pair_dir()}"


def _load_with_progress(engine, spec) -> None:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..core.errors import OutriderError

    engine.load(spec)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        transient=True,
        console=_stderr(),
    ) as progress:
        task = progress.add_task(f"loading {spec.model}")
        while engine.state == "loading":
            progress.update(task, description=f"loading {spec.model} ({engine.phase or 'queued'})")
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
) -> None:
    """Launch Claude Code against a running `outrider serve` (arguments after -- go to it)."""
    from ..cli import user_errors
    from ..core.errors import OutriderError
    from .claude import claude_env, probe, shell_exports

    with user_errors():
        health = probe(url, api_key)
        env = claude_env(dict(os.environ), url, api_key, health)
        if print_env:
            typer.echo(shell_exports(env, dict(os.environ)))
            return
        exe = shutil.which("claude")
        if exe is None:
            raise OutriderError(
                "Claude Code (`claude`) is not on PATH; install it, or use --print-env"
            )
        sys.stdout.flush()
        os.execve(exe, [exe, *ctx.args], env)
