"""Chat templates a request brings along (`chat_template`), rendered in a child process that
cannot hurt the server.

A template is a program: a 104-byte one can ask for gigabytes of output or hours of loops.
Jinja's sandbox stops it from touching Python internals but not from burning time and memory,
so the child renders under limits: CPU seconds and address space (set by the child on itself),
a wall-clock timeout (enforced by the parent, which kills the child), a cap on output characters
(checked while the template streams its output), a cap on the items all `range()` calls may
produce, and size checks on `*`, `**` and `+`. The parent only ever holds the capped output.

This file runs as a script in the child (`python -I template_sandbox.py`), so it imports only
the standard library and jinja2 at the top.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TIMEOUT_S = 10.0
MEMORY_BYTES = 1 << 30
MAX_OUTPUT_CHARS = 4 << 20
MAX_RANGE_ITEMS = 100_000


class TemplateRefused(ValueError):
    """The template failed, or went over one of the limits; the message says which."""


def render_untrusted(
    template: str,
    context: dict[str, Any],
    timeout_s: float = TIMEOUT_S,
    max_chars: int = MAX_OUTPUT_CHARS,
    memory_bytes: int = MEMORY_BYTES,
) -> str:
    """Render `template` with `context` (JSON-serialisable) in a limited child process."""
    payload = json.dumps(
        {
            "template": template,
            "context": context,
            "max_chars": max_chars,
            "memory_bytes": memory_bytes,
            # A backstop above the wall clock, so the parent's timeout is what normally fires.
            "cpu_s": int(timeout_s) + 2,
        },
        ensure_ascii=True,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-I", str(Path(__file__).resolve())],
            input=payload.encode(),
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TemplateRefused(f"the chat template ran longer than {timeout_s:g} s") from None
    try:
        answer = json.loads(done.stdout or b"{}")
    except ValueError:
        answer = {}
    if "text" in answer:
        return answer["text"]
    if "error" in answer:
        raise TemplateRefused(answer["error"])
    raise TemplateRefused(
        "the chat template was stopped by the sandbox's limits (exit status "
        f"{done.returncode}: CPU {int(timeout_s) + 2} s, memory {memory_bytes >> 20} MiB)"
    )


# -- the child --------------------------------------------------------------------------------


def _limit_self(memory_bytes: int, cpu_s: int) -> None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX: the parent's timeout still applies
        return
    for kind, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_s)):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):  # pragma: no cover - macOS refuses RLIMIT_AS
            pass


def _environment(max_chars: int):
    from datetime import datetime

    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    budget = [MAX_RANGE_ITEMS]

    def counted_range(*args: int) -> range:
        r = range(*args)
        budget[0] -= len(r)
        if budget[0] < 0:
            raise SecurityError(f"range() calls produced more than {MAX_RANGE_ITEMS} items")
        return r

    def too_big(value: Any) -> bool:
        return isinstance(value, (str, list, tuple, bytes)) and len(value) > max_chars

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 256:
                raise SecurityError("exponent too large")
            if operator == "*" and isinstance(left, int) != isinstance(right, int):
                count = left if isinstance(left, int) else right
                other = right if isinstance(left, int) else left
                if hasattr(other, "__len__") and len(other) * max(count, 0) > max_chars:
                    raise SecurityError("repetition result too large")
            result = super().call_binop(context, operator, left, right)
            if too_big(result):
                raise SecurityError("intermediate result too large")
            return result

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = Limited(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.pop("lipsum", None)
    env.globals.update(
        range=counted_range,
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
    )
    return env


def _child() -> None:
    request = json.loads(sys.stdin.buffer.read())
    max_chars = int(request["max_chars"])
    _limit_self(int(request["memory_bytes"]), int(request["cpu_s"]))
    try:
        from jinja2.exceptions import TemplateError

        env = _environment(max_chars)
        out, size = [], 0
        for piece in env.from_string(request["template"]).generate(**request["context"]):
            size += len(piece)
            if size > max_chars:
                raise TemplateError(f"the chat template's output passed {max_chars} characters")
            out.append(piece)
        answer: dict[str, str] = {"text": "".join(out)}
    except MemoryError:
        answer = {"error": "the chat template ran out of its memory limit"}
    except RecursionError:
        answer = {"error": "the chat template recursed too deeply"}
    except Exception as e:  # a broken template is the request's fault, whatever it raised
        answer = {"error": f"could not apply the request's chat template: {str(e)[:300]}"}
    sys.stdout.write(json.dumps(answer, ensure_ascii=True))


if __name__ == "__main__":
    _child()
