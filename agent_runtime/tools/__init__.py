"""Built-in tools (read_file, write_file, edit_file, list_files, grep, semantic_search,
run_command, finish). `default_tools` is imported lazily, so that importing the protocol
(`agent_runtime.tools.base`) does not load the tools' dependencies (numpy, sqlite, watchdog)."""

from agent_runtime.tools.base import Tool, ToolContext, ToolError, ToolResult, tool_schema

__all__ = ["Tool", "ToolContext", "ToolError", "ToolResult", "tool_schema", "default_tools"]


def __getattr__(name: str):
    if name == "default_tools":
        from agent_runtime.tools.registry import default_tools
        return default_tools
    raise AttributeError(f"module 'agent_runtime.tools' has no attribute {name!r}")
