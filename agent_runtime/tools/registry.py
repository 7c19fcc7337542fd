"""The built-in tool set, and the default plugin that registers it.

`default_tools()` makes fresh tool objects each call (they hold no session state). This module
is registered with the plugin manager before any entry point (`hooks.plugin_manager`), so the
built-ins reach the agent through the same `register_tools` hook a third-party package uses.
"""

from __future__ import annotations

from typing import Any, Callable

from agent_runtime.hooks import hookimpl

from agent_runtime.tools.base import Tool
from agent_runtime.tools.command import RunCommand
from agent_runtime.tools.files import EditFile, ReadFile, WriteFile
from agent_runtime.tools.finish import Finish
from agent_runtime.tools.search import Grep, ListFiles
from agent_runtime.tools.semantic import SemanticSearch


def default_tools() -> list[Tool]:
    """read_file, write_file, edit_file, list_files, grep, semantic_search, run_command, finish."""
    return [ReadFile(), WriteFile(), EditFile(), ListFiles(), Grep(), SemanticSearch(),
            RunCommand(), Finish()]


@hookimpl(tryfirst=True)
def register_tools(register: Callable[[Any], None]) -> None:
    """The default plugin: the built-ins, before any other plugin's tools."""
    for tool in default_tools():
        register(tool)
