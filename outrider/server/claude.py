"""`outrider claude`: launch Claude Code against a running `outrider serve`.

The configuration goes only into the child's environment (nothing is written to the user's
files); `--print-env` prints the same settings as shell exports instead, `--print-settings` as
the `env` block of a project's `.claude/settings.local.json`.
"""

from __future__ import annotations

import json
import shlex
import urllib.error
import urllib.request

from ..core.errors import OutriderError

# Other providers' switches: any one of them sends Claude Code elsewhere.
DROP = (
    "ANTHROPIC_API_KEY",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "CLAUDE_CODE_USE_MANTLE",
    "CLAUDE_CODE_USE_ANTHROPIC_AWS",
)
ALIASES = ("OPUS", "SONNET", "HAIKU", "FABLE")  # every model name Claude Code may pick
# Claude Code compacts a conversation at this share of the context window. It assumes a 200k
# window, and clamps lower values, so it is set only for windows of 100k tokens and more;
# below that, the server's "prompt is too long" answer makes it compact and retry.
COMPACT_AT, COMPACT_FROM = 0.8, 100_000

# What keeps Claude Code on the local server: no telemetry, error reports, auto-updates or other
# nonessential traffic (without these it also calls api.anthropic.com).
LOCAL_ONLY = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}


def probe(url: str, api_key: str | None, timeout: float = 5.0) -> dict:
    """The server's /health, or a clear error naming what went wrong."""
    req = urllib.request.Request(url.rstrip("/") + "/health")
    if api_key:
        req.add_header("x-api-key", api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise OutriderError(
                f"the server at {url} rejected the API key (pass --api-key)"
            ) from None
        raise OutriderError(f"the server at {url} answered /health with HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise OutriderError(
            f"no outrider server at {url} ({reason}); start one with `outrider serve`"
        ) from None


def claude_env(base: dict[str, str], url: str, api_key: str | None, health: dict) -> dict:
    """The child's environment: base minus other providers' settings, plus ours (the server,
    its model under every alias, and LOCAL_ONLY)."""
    model = health.get("model")
    if not model:
        raise OutriderError(f"the server at {url} has no model loaded (POST /admin/load first)")
    env = {k: v for k, v in base.items() if k not in DROP}
    env.update(
        ANTHROPIC_BASE_URL=url.rstrip("/"),
        ANTHROPIC_AUTH_TOKEN=api_key or "outrider",
        ANTHROPIC_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
    )
    env.update(LOCAL_ONLY)
    about = f"{model} on outrider ({health.get('mode') or 'speculative decoding'})"
    for alias in ALIASES:  # the picker shows the served model under each alias
        env[f"ANTHROPIC_DEFAULT_{alias}_MODEL"] = model
        env[f"ANTHROPIC_DEFAULT_{alias}_MODEL_NAME"] = model
        env[f"ANTHROPIC_DEFAULT_{alias}_MODEL_DESCRIPTION"] = about
    if health.get("max_output_tokens"):
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(health["max_output_tokens"])
    window = health.get("context_window")
    if isinstance(window, int) and window >= COMPACT_FROM:
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(int(window * COMPACT_AT))
    return env


def settings_block(env: dict[str, str], base: dict[str, str]) -> str:
    """What `claude_env` sets, as the `env` block of a `.claude/settings.local.json`
    (`--print-settings`): Claude Code run from that project then uses the server. Variables it
    drops cannot be unset from a settings file; the user's shell must not set them."""
    changed = {k: v for k, v in env.items() if base.get(k) != v}
    return json.dumps({"env": changed}, indent=2)


def shell_exports(env: dict[str, str], base: dict[str, str]) -> str:
    """What `claude_env` changes in `base`, as shell lines (`--print-env`)."""
    lines = [f"unset {k}" for k in DROP if k in base]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items() if base.get(k) != v]
    return "\n".join(lines)
