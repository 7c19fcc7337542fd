"""Built-in tools (read_file, write_file, edit_file, list_files, grep, semantic_search,
run_command, finish)."""

from agent_runtime.tools.base import Tool, ToolContext, ToolError, ToolResult, tool_schema

__all__ = ["Tool", "ToolContext", "ToolError", "ToolResult", "tool_schema"]
