"""Ready-to-paste settings that point coding agents at this server (`GET /admin/integrations`).

The server speaks OpenAI's and Anthropic's wire formats, so an agent needs only a base URL, a
model id and a key, but each spells them its own way (environment variables, a TOML provider, a
JSON provider, a settings form) and one wrong field fails quietly. Each entry says how, as steps:
`command` (run it), `env` (export these), `file` (put `content` in `path`), `fields` (type these
into the agent's settings).

The server's API key is never written out: where the server wants one, the settings name the
`OUTRIDER_API_KEY` variable (OpenCode's `{env:...}`, Codex's `env_key`) or a placeholder for the
user to fill in. Settings formats as the
agents document them: Claude Code's `ANTHROPIC_*` variables (as `outrider claude` sets them),
Codex's `[model_providers]` / `[profiles]` in `~/.codex/config.toml`, OpenCode's
`@ai-sdk/openai-compatible` provider in `opencode.json`, pi's `models.json` providers.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from .claude import claude_env

KEY_VARIABLE = "OUTRIDER_API_KEY"
NO_KEY = "outrider"  # what clients that insist on a key send to a server that wants none


def integrations(base_url: str, health: dict[str, Any], keyed: bool) -> list[dict[str, Any]]:
    """Every agent's settings for the server at `base_url` serving `health["model"]`;
    `keyed`: the server wants an API key."""
    base = base_url.rstrip("/")
    openai_base = base + "/v1"
    model = health["model"]
    placeholder = "<the server's --api-key>" if keyed else NO_KEY
    launch = ["outrider", "claude"]
    if base != "http://127.0.0.1:8080":
        launch += ["--url", base]
    env = claude_env({}, base, placeholder if keyed else None, health)
    return [
        {
            "id": "claude-code",
            "name": "Claude Code",
            "protocol": "anthropic",
            "setup": [
                {
                    "kind": "command",
                    "label": "Launch it on this server (only the launched process is set up)",
                    "command": " ".join(shlex.quote(p) for p in launch)
                    + (f"  # with {KEY_VARIABLE} set" if keyed else ""),
                },
                {"kind": "env", "label": "or export these yourself", "env": env},
            ],
        },
        {
            "id": "codex",
            "name": "Codex CLI",
            "protocol": "openai",
            "setup": [
                {
                    "kind": "file",
                    "label": "Add a provider and a profile",
                    "path": "~/.codex/config.toml",
                    "content": _codex(openai_base, model, keyed),
                },
                {"kind": "command", "label": "then run", "command": "codex --profile outrider"},
            ],
        },
        {
            "id": "opencode",
            "name": "OpenCode",
            "protocol": "openai",
            "setup": [
                {
                    "kind": "file",
                    "label": "Add the provider (project root, or ~/.config/opencode/)",
                    "path": "opencode.json",
                    "content": _opencode(
                        openai_base, model, f"{{env:{KEY_VARIABLE}}}" if keyed else NO_KEY
                    ),
                }
            ],
        },
        {
            "id": "pi",
            "name": "pi",
            "protocol": "openai",
            "setup": [
                {
                    "kind": "file",
                    "label": "Add the provider",
                    "path": "~/.pi/models.json",
                    "content": _pi(openai_base, model, placeholder),
                }
            ],
        },
        {
            "id": "openai-compatible",
            "name": "Any OpenAI-compatible app (Cline, Continue, Zed, Open WebUI)",
            "protocol": "openai",
            "setup": [
                {
                    "kind": "fields",
                    "label": "Provider settings",
                    "fields": {"Base URL": openai_base, "API key": placeholder, "Model": model},
                }
            ],
        },
    ]


def _codex(openai_base: str, model: str, keyed: bool) -> str:
    lines = [
        "[model_providers.outrider]",
        'name = "outrider"',
        f"base_url = {json.dumps(openai_base)}",
        'wire_api = "chat"',
    ]
    if keyed:
        lines.append(f'env_key = "{KEY_VARIABLE}"')
    lines += [
        "",
        "[profiles.outrider]",
        'model_provider = "outrider"',
        f"model = {json.dumps(model)}",
    ]
    return "\n".join(lines) + "\n"


def _opencode(openai_base: str, model: str, key: str) -> str:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "outrider",
        "options": {"baseURL": openai_base, "apiKey": key},
        "models": {model: {"name": model}},
    }
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"outrider": provider}}
    return json.dumps(config, indent=2)


def _pi(openai_base: str, model: str, key: str) -> str:
    provider = {
        "type": "openai",
        "base_url": openai_base,
        "api_key": key,
        "models": [{"id": model, "name": f"{model} (outrider)"}],
    }
    return json.dumps({"providers": {"outrider": provider}}, indent=2)
