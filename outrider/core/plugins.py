"""The plugin manager and the catalogue of what the installed plugins provide."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import version as dist_version

import pluggy

from . import hookspecs
from .errors import OutriderError


@dataclass
class PluginInfo:
    name: str
    version: str
    provides: list[str] = field(default_factory=list)
    builtin: bool = True


def _manager(builtins: bool, entrypoints: bool) -> pluggy.PluginManager:
    """outrider's hooks, with the built-in plugins (first) and the installed ones' entry points."""
    pm = pluggy.PluginManager("outrider")
    pm.add_hookspecs(hookspecs)
    if builtins:
        from ..plugins import BUILTIN

        for module in BUILTIN:
            pm.register(module, name=module.__name__)
    if entrypoints:
        pm.load_setuptools_entrypoints("outrider")
    return pm


class CommandPlugins:
    """The installed plugins that may add commands to the CLI: third-party ones, loaded from
    their entry points alone. The built-in plugins add none, and importing them brings in
    mlx-lm and transformers (1.2 s of a 2.1 s `outrider --help` on a 2-core CPU), which a
    command that needs a model imports when it loads one (`Plugins`)."""

    def __init__(self) -> None:
        self.pm = _manager(builtins=False, entrypoints=True)

    def register_commands(self, cli) -> None:
        self.pm.hook.register_commands(cli=cli)


class Plugins:
    """Everything the plugins provide, collected once per process that asks for it."""

    def __init__(self, load_entrypoints: bool = True) -> None:
        self.pm = _manager(builtins=True, entrypoints=load_entrypoints)
        self.families: dict = {}
        self.formats: dict = {}
        self.strategies: dict = {}
        self.kernels: dict = {}
        self._owner: dict[str, list[str]] = {}
        for plugin in self.pm.get_plugins():
            self._collect(plugin, self.pm.get_name(plugin))

    def _collect(self, plugin, name: str) -> None:
        provided: list[str] = []

        def registrar(kind: str, table: dict):
            def register(thing) -> None:
                if thing.name in table:
                    raise OutriderError(f"plugin {name} registers {kind} {thing.name!r} twice")
                table[thing.name] = thing
                provided.append(f"{kind}:{thing.name}")

            return register

        for hook_name, kind, table in (
            ("register_target_families", "family", self.families),
            ("register_drafter_formats", "format", self.formats),
            ("register_strategies", "strategy", self.strategies),
            ("register_matmul_kernels", "kernel", self.kernels),
        ):
            impl = getattr(plugin, hook_name, None)
            if impl is not None:
                impl(registrar(kind, table))
        if getattr(plugin, "register_commands", None) is not None:
            provided.append("commands")
        self._owner[name] = provided

    def register_commands(self, cli) -> None:
        self.pm.hook.register_commands(cli=cli)

    def info(self) -> list[PluginInfo]:
        dists = {id(p): d for p, d in self.pm.list_plugin_distinfo()}
        out = []
        for plugin in self.pm.get_plugins():
            name = self.pm.get_name(plugin)
            dist = dists.get(id(plugin))
            builtin = dist is None
            if builtin:
                try:
                    ver = dist_version("outrider")
                except Exception:
                    ver = "source"
            else:
                ver = f"{dist.version} ({dist.project_name})"
            out.append(PluginInfo(name, ver, self._owner.get(name, []), builtin))
        return sorted(out, key=lambda p: (not p.builtin, p.name))

    def strategy(self, name: str):
        try:
            return self.strategies[name]
        except KeyError:
            known = ", ".join(sorted(self.strategies)) + ", auto"
            raise OutriderError(f"unknown mode {name!r}; known modes: {known}") from None
