"""Running the `outrider` command line from tests: in this process (typer's runner) or as the
real entry point in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from outrider import cli

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli.app, list(args), input=input)


def module_env(env: dict | None = None) -> dict:
    """This environment for a `python -m outrider` child: this checkout, no debug tracebacks."""
    full_env = {k: v for k, v in os.environ.items() if k != "OUTRIDER_DEBUG"}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return full_env


def run_module(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real entry point (`python -m outrider`), stdout a pipe, not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "outrider", *args],
        capture_output=True,
        env=module_env(env),
        timeout=300,
    )
