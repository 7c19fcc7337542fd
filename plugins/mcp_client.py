"""MCP in: the tools of Model Context Protocol servers as extra agent tools (official `mcp` SDK).

Servers come from `$APPRENTICE_HOME/config.toml` (`[mcp_servers.NAME]` with `command`, `args`,
`env`, as Codex writes them), from a workspace's `.mcp.json` (`{"mcpServers": {NAME: {...}}}`,
as Claude Code writes it; it wins over config.toml for the same name), and from an editor's
`mcpServers` in ACP's `session/new` (`plugins.acp`). A repository's `.mcp.json` is not the
user's own: its servers start only once the user trusts them (`apprentice trust-mcp`, kept
in approvals.json by name and fingerprint, so a changed command needs trusting again). Each server is a subprocess over stdio,
started when an agent is built; its tools are named `mcp__SERVER__TOOL` and reach the policy's
tool list like the built-ins.

The connections live on one background event loop (`McpHub`); a tool call blocks the agent's
thread until the result comes or the server's `tool_timeout` passes. A server that crashes,
hangs or fails to start ends in a `ToolError` (or a logged warning at start), never a hung
agent. MCP tools set `needs_approval`, so the approval gate asks for them like for commands.
This module does not sandbox servers (they run as the user, like the editor's own MCP servers)
and speaks stdio only.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import threading
import tomllib
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from agent_runtime.hooks import hookimpl
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult

log = logging.getLogger(__name__)
MAX_RESULT_CHARS = 40_000                      # longer tool results keep their start and end


@dataclass
class McpServerConfig:
    name: str                                  # the server's name; tools are mcp__NAME__TOOL
    command: str                               # executable to start (looked up on PATH)
    args: list[str] = field(default_factory=list)  # its arguments
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables
    cwd: str | None = None                     # working directory (default: the workspace)
    startup_timeout: float = 20.0              # seconds to start and list tools, else skipped
    tool_timeout: float = 60.0                 # seconds a call may take, else a tool error
    from_workspace: bool = False               # declared by the workspace's .mcp.json

    def trust_rule(self) -> str:
        """The approvals.json rule that trusts this exact server (name, command, args, env)."""
        spec = json.dumps([self.command, self.args, self.env, self.cwd], sort_keys=True)
        return f"mcp_server:{self.name}@{hashlib.sha256(spec.encode()).hexdigest()[:16]}"

    @classmethod
    def from_dict(cls, name: str, entry: Any, where: str) -> "McpServerConfig":
        """One entry of config.toml or .mcp.json; ValueError says what is wrong and where."""
        if not isinstance(entry, dict) or not isinstance(entry.get("command"), str):
            raise ValueError(f"{where}: MCP server {name!r} needs a `command` string")
        args, env = entry.get("args") or [], entry.get("env") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: MCP server {name!r}: `args` must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"{where}: MCP server {name!r}: `env` must map names to strings")
        return cls(name, entry["command"], list(args), dict(env), entry.get("cwd"),
                   float(entry.get("startup_timeout_sec", cls.startup_timeout)),
                   float(entry.get("tool_timeout_sec", cls.tool_timeout)))


def load_configs(home: Path, workspace: Path | None) -> list[McpServerConfig]:
    """The MCP servers of config.toml and the workspace's .mcp.json; a broken file is logged
    and skipped (it must not stop the agent)."""
    servers: dict[str, McpServerConfig] = {}
    sources: list[tuple[Path, Callable[[bytes], dict], str]] = [
        (home / "config.toml", lambda b: tomllib.loads(b.decode()), "mcp_servers")]
    if workspace is not None:
        sources.append((workspace / ".mcp.json", json.loads, "mcpServers"))
    for path, parse, key in sources:
        if not path.is_file():
            continue
        try:
            table = parse(path.read_bytes()).get(key) or {}
            if not isinstance(table, dict):
                raise ValueError(f"{path}: `{key}` must be a table of servers")
            for name, entry in table.items():
                servers[name] = McpServerConfig.from_dict(name, entry, str(path))
                servers[name].from_workspace = path.name == ".mcp.json"
        except (ValueError, UnicodeDecodeError, AttributeError) as exc:
            log.warning("MCP servers in %s ignored: %s", path, exc)
    return list(servers.values())


class McpHub:
    """Connections to MCP servers on one background event loop (a daemon thread)."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()          # guards the loop's creation
        self._connecting = threading.Lock()    # one start at a time: no server started twice
        self._connections: dict[str, _Connection] = {}

    def _run(self, coro: Any, timeout: float) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="mcp-hub",
                                 daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    def tools(self, config: McpServerConfig, workspace: Path | None) -> list["McpTool"]:
        """Start `config`'s server (once per name and command) and wrap its tools; [] with
        a warning when it cannot start or list them within its startup timeout."""
        key = json.dumps([config.name, config.command, config.args, config.env,
                          config.cwd or str(workspace or "")])
        connection = None
        try:
            with self._connecting:
                connection = self._connections.get(key)
                if connection is None or connection.dead:
                    connection = _Connection(config, workspace)
                    self._connections[key] = connection
                    self._run(connection.start(), config.startup_timeout)
            listed = self._run(connection.list_tools(), config.startup_timeout)
        except Exception as exc:                # a missing command, a crash, a hang
            reason = "timed out" if isinstance(exc, FutureTimeout) else f"{type(exc).__name__}: {exc}"
            log.warning("MCP server %s did not start (%s); its tools are not available",
                        config.name, reason)
            if connection is not None:
                self.stop(connection)
            return []
        return [McpTool(self, connection, t) for t in listed]

    def call(self, connection: "_Connection", tool: str, arguments: dict) -> Any:
        if connection.dead:
            raise ToolError(f"the MCP server {connection.config.name} has stopped "
                            f"({connection.dead}); its tools cannot run now")
        return self._run(connection.call(tool, arguments), connection.config.tool_timeout)

    def stop(self, connection: "_Connection") -> None:
        if self._loop is not None:
            try:
                self._run(connection.stop(), 10)
            except Exception:                   # stopping a broken server: nothing to save
                pass

    def close(self) -> None:
        """Stop every server this hub started."""
        for connection in list(self._connections.values()):
            self.stop(connection)
        self._connections.clear()


class _Connection:
    """One server: a task that holds the SDK client open until `stop`."""

    def __init__(self, config: McpServerConfig, workspace: Path | None):
        self.config, self.workspace = config, workspace
        self.client: Any = None
        self.dead: str | None = None           # why the connection ended, once it has
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._serve(ready))
        await ready

    async def _serve(self, ready: asyncio.Future) -> None:
        from mcp import Client, StdioServerParameters
        params = StdioServerParameters(
            command=self.config.command, args=self.config.args, env=self.config.env or None,
            cwd=self.config.cwd or (str(self.workspace) if self.workspace else None))
        try:
            async with Client(params, client_info=_client_info()) as client:
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
            self.dead = "stopped"
        except BaseException as exc:            # the process died or never spoke MCP
            self.dead = f"{type(exc).__name__}: {exc}" or "exited"
            if not ready.done():
                ready.set_exception(RuntimeError(self.dead))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def list_tools(self) -> list[Any]:
        tools, cursor = [], None
        while True:
            page = await self.client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                return tools

    async def call(self, tool: str, arguments: dict) -> Any:
        return await self.client.call_tool(tool, arguments)

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
        self.dead = self.dead or "stopped"


def _client_info() -> Any:
    from mcp import Implementation
    return Implementation(name="apprentice", version="0.1.0")


class McpTool:
    """An MCP server's tool as an agent `Tool`."""

    needs_approval = True                      # unknown effects: the gate asks as for commands

    def __init__(self, hub: McpHub, connection: _Connection, tool: Any):
        self.hub, self.connection, self.remote_name = hub, connection, tool.name
        server = connection.config.name
        self.name = f"mcp__{server}__{tool.name}"
        self.description = (tool.description or tool.title or tool.name) + \
            f" (tool of the MCP server `{server}`)"
        schema = dict(tool.input_schema or {})
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        self.parameters = schema
        hints = tool.annotations
        self.mutates = not (hints is not None and hints.read_only_hint)

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        server, timeout = self.connection.config.name, self.connection.config.tool_timeout
        try:
            result = self.hub.call(self.connection, self.remote_name, args)
        except FutureTimeout:
            raise ToolError(f"{self.name}: the MCP server {server} did not answer within "
                            f"{timeout:g} s; the call was abandoned") from None
        except ToolError:
            raise
        except Exception as exc:                # the server crashed or broke the protocol
            raise ToolError(f"{self.name}: the MCP server {server} failed: "
                            f"{type(exc).__name__}: {exc}") from None
        text = _result_text(result)
        if result.is_error:
            raise ToolError(f"{self.name} reported an error: {text}")
        return ToolResult(text, {"mcp_server": server, "mcp_tool": self.remote_name})


def _result_text(result: Any) -> str:
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')} "
                                                   "content not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) or "(no output)"
    if len(text) > MAX_RESULT_CHARS:
        half = MAX_RESULT_CHARS // 2
        text = text[:half] + f"\n… [{len(text) - MAX_RESULT_CHARS} characters cut] …\n" + text[-half:]
    return text


_hub: McpHub | None = None


def hub() -> McpHub:
    """The process-wide hub for configured servers; its servers stop at exit."""
    global _hub
    if _hub is None:
        _hub = McpHub()
        atexit.register(_hub.close)
    return _hub


def untrusted(configs: list[McpServerConfig], home: Path,
              workspace: Path | None) -> list[McpServerConfig]:
    """The workspace-declared servers among `configs` that the user has not trusted."""
    from agent_runtime.approvals import ApprovalStore
    trusted = ApprovalStore(home).rules(workspace) if workspace is not None else set()
    return [c for c in configs if c.from_workspace and c.trust_rule() not in trusted]


@hookimpl
def register_tools(register: Callable[[Any], None], workspace: Path | None) -> None:
    """The tools of the servers in config.toml and the trusted ones of .mcp.json."""
    from agent_runtime.store import default_home
    configs = load_configs(default_home(), workspace)
    skipped = untrusted(configs, default_home(), workspace)
    for config in skipped:
        log.warning("MCP server %s of %s/.mcp.json is not started: it is not trusted yet "
                    "(`apprentice trust-mcp -w %s` after checking its command)",
                    config.name, workspace, workspace)
    for config in configs:
        if config not in skipped:
            for tool in hub().tools(config, workspace):
                register(tool)


@click.command("trust-mcp")
@click.option("-w", "--workspace", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=".", show_default=True, help="The workspace whose .mcp.json to trust.")
@click.option("--yes", is_flag=True, help="Trust without asking.")
def trust_mcp_command(workspace: Path, yes: bool) -> None:
    """Trust the MCP servers of a workspace's .mcp.json, so apprentice starts them."""
    from agent_runtime.approvals import ApprovalStore
    from agent_runtime.store import default_home
    workspace = workspace.resolve()
    waiting = untrusted(load_configs(default_home(), workspace), default_home(), workspace)
    if not waiting:
        click.echo(f"no untrusted MCP servers in {workspace / '.mcp.json'}")
        return
    for config in waiting:
        click.echo(f"{config.name}: {' '.join([config.command, *config.args])}"
                   + (f"  (env: {', '.join(sorted(config.env))})" if config.env else ""))
    if yes or click.confirm("Start these servers (as you, unsandboxed) when apprentice works "
                            "in this workspace?"):
        for config in waiting:
            ApprovalStore(default_home()).allow(workspace, config.trust_rule())
        click.echo(f"trusted {len(waiting)} server(s)")


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(trust_mcp_command)
