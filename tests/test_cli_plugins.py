"""`outrider plugins` and the commands plugins add: what is installed is listed, and a broken
plugin costs one warning line, never the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import typer
from cli_runner import invoke
from typer.testing import CliRunner

from outrider import cli, cli_common
from outrider.core.hookspecs import hookimpl
from outrider.core.plugins import Plugins


def test_plugins_table_and_json():
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    for name in ("dense", "deepspec", "zlab", "dspark", "dflash", "lookup", "baseline"):
        assert name in result.stdout
    rows = json.loads(invoke("plugins", "--json").stdout)
    assert {"name", "version", "provides"} <= set(rows[0])
    names = " ".join(r["name"] for r in rows)
    for name in ("dense", "deepspec", "zlab", "dspark", "lookup"):
        assert name in names
    provides = {p for r in rows for p in r["provides"]}
    assert {"family:dense", "format:zlab", "strategy:dspark"} <= provides


# --- plugin robustness -----------------------------------------------------------------------


def test_failing_third_party_plugin_is_one_warning(monkeypatch, capsys):
    real = cli_common.Plugins

    def flaky(load_entrypoints: bool = True):
        if load_entrypoints:
            raise RuntimeError("broken plugin")
        return real(load_entrypoints=False)

    monkeypatch.setattr(cli_common, "Plugins", flaky)
    cli.plugins.cache_clear()
    try:
        found = cli.plugins()
    finally:
        cli.plugins.cache_clear()
    assert "dense" in found.families
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and len(err.strip().splitlines()) == 1


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def builtin() -> None:
        """A stand-in for the built-in commands."""

    return app


def test_plugins_add_commands(monkeypatch):
    class HelloPlugin:
        @hookimpl
        def register_commands(self, cli):
            @cli.command()
            def hello() -> None:
                typer.echo("hello from a plugin")

    found = Plugins(load_entrypoints=False)
    found.pm.register(HelloPlugin(), name="hello-plugin")
    monkeypatch.setattr(cli, "command_plugins", lambda: found)
    app = make_app()
    cli.add_plugin_commands(app)
    cli.add_plugin_commands(app)  # once per app
    result = CliRunner().invoke(app, ["hello"])
    assert result.exit_code == 0 and result.stdout == "hello from a plugin\n"


def test_no_built_in_plugin_adds_commands():
    """The CLI asks only third-party plugins for commands (`CommandPlugins`: the built-ins
    import mlx-lm); a built-in that added one would be missed, so none may."""
    from outrider.plugins import BUILTIN

    assert BUILTIN and not [m.__name__ for m in BUILTIN if hasattr(m, "register_commands")]


def test_plugin_failing_to_add_commands_is_one_warning(monkeypatch, capsys):
    class Broken:
        def register_commands(self, cli):
            raise RuntimeError("no commands today")

    monkeypatch.setattr(cli, "command_plugins", lambda: Broken())
    app = make_app()
    cli.add_plugin_commands(app)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "no commands today" in err
    assert CliRunner().invoke(app, ["--help"]).exit_code == 0


def test_a_plugin_that_fails_to_import_is_one_warning(tmp_path):
    """An installed plugin whose module raises on import: `outrider plugins` (which asks for
    commands at start, then builds the catalogue) lists the built-ins, with one warning line."""
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[outrider]\nbroken = broken_plugin_module\n")
    (tmp_path / "broken_plugin_module.py").write_text("raise ImportError('no such thing')\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    done = subprocess.run(
        [sys.executable, "-m", "outrider", "plugins", "--json"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "strategy:dspark" in {p for row in json.loads(done.stdout) for p in row["provides"]}
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no such thing" in warnings[0], done.stderr


def test_plugins_piped_prints_whole_names():
    result = invoke("plugins")
    names = [line.split("\t")[0] for line in result.stdout.splitlines()]
    assert "outrider.plugins.strategies.baseline" in names
    assert "outrider.plugins.targets.hybrid" in names and "…" not in result.stdout
