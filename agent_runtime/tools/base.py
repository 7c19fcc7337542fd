"""The `Tool` protocol and the values tools exchange with the agent loop.

A tool is a named callable with a JSON-schema description. The loop validates arguments
against `parameters` before calling, so a tool may assume the required keys exist with the
declared JSON types. Tools report expected failures (missing file, no match) by raising
`ToolError` with a message written for the model; anything else is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class ToolError(Exception):
    """An expected failure, shown to the model verbatim as the tool's result."""


@dataclass
class ToolResult:
    text: str                                  # what the model sees
    data: dict[str, Any] = field(default_factory=dict)  # structured extras for UIs (diff, exit code ...)


@dataclass
class ToolContext:
    workspace: Path                            # every path resolves inside this root
    session_dir: Path | None = None            # where large outputs are saved
    sandbox: Any = None                        # agent_runtime.sandbox.Sandbox, when commands run
    extras: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]                 # JSON schema of the arguments object
    mutates: bool                              # writes run in order; reads may run concurrently
    # Optional: `references = {"path": "file", ...}`, what some string arguments name, so that
    # a model's calls can be held to existing files while it writes them
    # (`agent_runtime.callgrammar`: file, dir, path, text:ARG, differs:ARG).

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function description chat templates expect in `tools=`."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description,
                         "parameters": tool.parameters}}
