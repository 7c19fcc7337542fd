"""MCP out: `apprentice mcp` serves apprentice as an MCP server over stdio (official `mcp` SDK).

Other agents (Claude Code, Codex, any MCP client) delegate a coding task with the `run_task`
tool: apprentice runs its agent loop on the task in a workspace below `--workspace-root` and
returns the status, the summary, the session id and the unified diffs of the files it changed.
Every run is an ordinary session in the store (`apprentice sessions list`), rateable like any.

Nobody is there to approve calls, so tools run as in `apprentice run`: commands inside the
bubblewrap sandbox, edits confined to the workspace. Changes made by commands are not in the
returned diff (only those of the file tools are). A line on stdin that is not a JSON-RPC
message gets a JSON-RPC error (the SDK alone drops it silently). This module does not stream
progress.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import click

from agent_runtime.hooks import hookimpl


@dataclass
class McpServeConfig:
    policy_spec: str = "default"               # --policy or --model: what load_policy gets
    max_steps: int = 50                        # default step budget of one run_task
    workspace_root: Path = Path(".")           # run_task workspaces must lie below this folder


class TaskResult(TypedDict):
    status: str                                # finished | failed | budget_exhausted | cancelled
    summary: str                               # finish()'s summary, or why the run stopped
    session_id: str                            # the session in the store (`apprentice sessions show`)
    steps: int                                 # model calls the run made
    diff: str                                  # unified diffs of the files the file tools changed


class Delegate:
    """Runs tasks for MCP callers: one policy, loaded on first use, shared by every run."""

    def __init__(self, config: McpServeConfig):
        self.config = config
        self.root = config.workspace_root.resolve()
        self._policy: Any = None
        self._lock = threading.Lock()

    def policy(self) -> Any:
        with self._lock:
            if self._policy is None:
                from mcp.server.mcpserver.exceptions import ToolError

                from agent_runtime.policies import load_policy
                try:
                    self._policy = load_policy(self.config.policy_spec)
                except (OSError, ValueError) as exc:
                    raise ToolError(f"apprentice cannot load its policy "
                                    f"{self.config.policy_spec!r}: {exc}") from None
            return self._policy

    def workspace(self, path: str) -> Path:
        """`path` (relative to the root, or absolute) resolved; a tool error outside the root."""
        from mcp.server.mcpserver.exceptions import ToolError
        resolved = (self.root / path).resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise ToolError(f"workspace {path!r} is outside the served root {self.root}")
        if not resolved.is_dir():
            raise ToolError(f"workspace {path!r} is not a directory")
        return resolved

    def run_task(self, task: str, workspace: str, max_steps: int | None) -> TaskResult:
        from mcp.server.mcpserver.exceptions import ToolError

        from agent_runtime.agent import Agent, AgentConfig, Callbacks
        from agent_runtime.learning import session_learns
        from agent_runtime.store import SessionStore
        if not task.strip():
            raise ToolError("task is empty")
        root = self.workspace(workspace)
        diffs: list[str] = []

        def on_tool_end(call: Any, outcome: Any) -> None:
            if outcome.ok and outcome.data.get("diff"):
                diffs.append(outcome.data["diff"])

        with SessionStore() as store:
            agent = Agent(self.policy(), store=store, workspace=root,
                          config=AgentConfig(max_steps=max_steps or self.config.max_steps,
                                             learn=session_learns(store.home, root)),
                          callbacks=Callbacks(on_tool_end=on_tool_end))
            result = agent.run(task)
        return TaskResult(status=result.status, summary=result.summary or "",
                          session_id=result.session_id, steps=result.steps, diff="".join(diffs))


def make_server(config: McpServeConfig) -> Any:
    """The MCP server object (`mcp.server.mcpserver.MCPServer`) with apprentice's tools."""
    import anyio
    from mcp.server.mcpserver import MCPServer
    delegate = Delegate(config)
    server = MCPServer("apprentice", instructions=(
        "apprentice is a local coding agent. Give `run_task` a self-contained coding task and "
        "a workspace folder; it edits files and runs commands there, then returns what it did."))

    @server.tool()
    async def run_task(task: str, workspace: str = ".",
                       max_steps: int | None = None) -> TaskResult:
        """Run apprentice's coding agent on `task` in `workspace` (a folder below the served
        root, default the root itself). Returns status (finished, failed, budget_exhausted,
        cancelled), summary, session_id, steps and the unified diff of the files it changed."""
        return await anyio.to_thread.run_sync(delegate.run_task, task, workspace, max_steps)

    return server


@click.command("mcp")
@click.option("--model", default="default", show_default=True,
              help="Policy checkpoint: a model directory, or 'default' for the bundled one.")
@click.option("--policy", "policy_spec", metavar="SPEC",
              help="Policy spec overriding --model, e.g. 'replay:FILE'.")
@click.option("--max-steps", type=click.IntRange(1), default=50, show_default=True,
              help="Default step budget of one run_task call.")
@click.option("--workspace-root", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=".", show_default=True,
              help="run_task workspaces must lie below this folder.")
def mcp_command(model: str, policy_spec: str | None, max_steps: int,
                workspace_root: Path) -> None:
    """Serve apprentice as an MCP server on stdio (a `run_task` tool for other agents)."""
    import anyio

    from agent_runtime.policies import check_policy
    try:
        check_policy(policy_spec or model)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load policy {policy_spec or model!r}: {exc}")
    config = McpServeConfig(policy_spec or model, max_steps, workspace_root)
    anyio.run(serve_stdio, make_server(config))


async def serve_stdio(server: Any) -> None:
    """`server` on stdin/stdout, as `MCPServer.run("stdio")` does, except that a line that is
    not a JSON-RPC message gets a JSON-RPC error answer (-32700 for bad JSON, -32600 for a
    wrong shape) instead of being dropped silently; then serving goes on."""
    import anyio
    import mcp_types as types
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage

    lowlevel = server._lowlevel_server          # what MCPServer.run_stdio_async serves too
    async with stdio_server() as (read_stream, write_stream):
        checked_writer, checked = anyio.create_memory_object_stream[Any](0)

        async def check() -> None:
            async with checked_writer:
                async for item in read_stream:
                    if not isinstance(item, Exception):
                        await checked_writer.send(item)
                        continue
                    bad_json = "json_invalid" in str(item) or "Invalid JSON" in str(item)
                    code = types.PARSE_ERROR if bad_json else types.INVALID_REQUEST
                    error = types.ErrorData(code=code, message="Parse error" if bad_json
                                            else "Invalid request", data=str(item)[:500])
                    await write_stream.send(SessionMessage(types.JSONRPCError(
                        jsonrpc="2.0", id=None, error=error)))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(check)
            await lowlevel.run(checked, write_stream, lowlevel.create_initialization_options())
            tasks.cancel_scope.cancel()


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(mcp_command)
