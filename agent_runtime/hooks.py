"""Plugin hooks (pluggy), in the style of simonw/llm: each hook takes a `register` callback.

Packages add commands, tools and feedback sources without the runtime importing them:
`learner`, `tui` and `plugins` register through the `apprentice` entry-point group in
pyproject.toml, and third-party packages do the same. The built-in tools are themselves a
plugin (`agent_runtime.tools.registry`), registered first. This module declares the hooks,
loads plugins and collects what they register; it does not run tools or commands.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("apprentice")
hookimpl = pluggy.HookimplMarker("apprentice")
log = logging.getLogger(__name__)


class Specs:
    @hookspec
    def register_commands(self, cli: Any) -> None:
        """Add click commands or groups to the `apprentice` CLI group `cli`."""

    @hookspec
    def register_tools(self, register: Callable[[Any], None], workspace: Path | None) -> None:
        """Call `register(tool)` for each `Tool` the agent may use in `workspace` (the
        resolved workspace root, or None when unknown). An implementation may take only
        `register`. A later tool with the name of an earlier one replaces it."""

    @hookspec
    def register_feedback_sources(self, register: Callable[[str, str], None]) -> None:
        """Call `register(name, description)` for each feedback source (the `source` column
        of the store's feedback table) a plugin records, e.g. an implicit signal."""


_pm: pluggy.PluginManager | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager: the built-in tools, then every `apprentice` entry
    point, loaded once."""
    global _pm
    if _pm is None:
        from agent_runtime.tools import registry
        pm = pluggy.PluginManager("apprentice")
        pm.add_hookspecs(Specs)
        pm.register(registry, name="builtin_tools")
        pm.load_setuptools_entrypoints("apprentice")
        _pm = pm
    return _pm


def plugin_tools(workspace: str | Path | None = None) -> list[Any]:
    """Every tool the registered plugins offer for `workspace`, built-ins first."""
    tools: dict[str, Any] = {}

    def register(tool: Any) -> None:
        if tool.name in tools:
            log.info("tool %s registered again; the later registration wins", tool.name)
            tools.pop(tool.name)
        tools[tool.name] = tool

    root = Path(workspace).resolve() if workspace is not None else None
    plugin_manager().hook.register_tools(register=register, workspace=root)
    return list(tools.values())


def feedback_sources() -> dict[str, str]:
    """{source name: description} of every feedback source plugins declare."""
    from agent_runtime.names import SOURCE_DESCRIPTIONS
    sources = dict(SOURCE_DESCRIPTIONS)
    plugin_manager().hook.register_feedback_sources(
        register=lambda name, description: sources.setdefault(name, description))
    return sources
