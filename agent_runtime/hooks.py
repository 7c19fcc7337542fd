"""Plugin hooks (pluggy), in the style of simonw/llm: each hook takes a `register` callback.

Packages add commands and tools without the runtime importing them: `learner` and `tui`
register their commands through the `apprentice` entry-point group in pyproject.toml, and
third-party plugins do the same. This module only declares hooks and loads plugins.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("apprentice")
hookimpl = pluggy.HookimplMarker("apprentice")


class Specs:
    @hookspec
    def register_commands(self, cli: Any) -> None:
        """Add click commands or groups to the `apprentice` CLI group `cli`."""

    @hookspec
    def register_tools(self, register: Callable[[Any], None]) -> None:
        """Call `register(tool)` for each extra `Tool` the agent may use."""


_pm: pluggy.PluginManager | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every `apprentice` entry point loaded once."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager("apprentice")
        pm.add_hookspecs(Specs)
        pm.load_setuptools_entrypoints("apprentice")
        _pm = pm
    return _pm
