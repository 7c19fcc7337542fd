"""Built-in tools (read_file, write_file, edit_file, list_files, grep, semantic_search,
run_command, finish)."""

from agent_runtime.tools.base import Tool, ToolContext, ToolError, ToolResult, tool_schema
from agent_runtime.tools.registry import default_tools

__all__ = ["Tool", "ToolContext", "ToolError", "ToolResult", "tool_schema", "default_tools"]
