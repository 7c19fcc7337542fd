"""The built-in tool set. `default_tools()` is what the agent loop and the default plugin
register; it makes fresh tool objects each call (they hold no session state)."""

from __future__ import annotations

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
