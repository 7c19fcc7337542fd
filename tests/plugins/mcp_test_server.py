"""A small MCP server over stdio, made with the official SDK, for the MCP tests.

Tools: `echo` (returns its text), `add` (read-only), `crash` (the process exits at once),
`hang` (never answers), `fail` (an MCP error result). Started as `python mcp_test_server.py`.
"""

import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("testsrv")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
def hang() -> str:
    """Never answer."""
    time.sleep(3600)
    return "unreachable"


@server.tool()
def fail() -> str:
    """Raise an error (an error result)."""
    raise RuntimeError("the widget is broken")


if __name__ == "__main__":
    server.run("stdio")
