"""`apprentice acp`: apprentice as an Agent Client Protocol agent (official `acp` SDK).

Editors (Zed, JetBrains, Neovim's CodeCompanion and avante, Emacs) start `apprentice acp` and
speak JSON-RPC on its stdin/stdout. Every ACP session is an ordinary apprentice session in the
store (same id), so it shows in `apprentice sessions list`, can be resumed from the command
line, and what learns from use learns from it.

- `initialize` states what is true: sessions load, prompts take text and embedded context
  (no images or audio), MCP servers over stdio (not http/sse).
- `session/new` checks the folder, starts the session's MCP servers (`mcpServers`, stdio),
  and offers the approval modes as session modes; `session/load` streams the stored history
  (user text, agent text, tool calls with their results) before it answers.
- `session/prompt` runs the agent to its `finish` (stop reason `end_turn`), its step budget
  (`max_turn_requests`) or a `session/cancel` (`cancelled`). A prompt `/good` or `/bad
  [reason] [comment]` rates the session's latest agent turn instead of running the agent.
Tool calls, permissions and file access are `session.py`'s business; framing is `wire.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acp import PROTOCOL_VERSION, RequestError, helpers
from acp.schema import (AgentCapabilities, AvailableCommand, AvailableCommandInput,
                        Implementation, InitializeResponse, LoadSessionResponse, McpCapabilities,
                        NewSessionResponse, PromptCapabilities, PromptResponse, SessionMode,
                        SessionModeState, SetSessionModeResponse, UnstructuredCommandInput)

from agent_runtime import names
from agent_runtime.approvals import MODES
from agent_runtime.hooks import plugin_tools
from plugins.acp.history import replay_history
from plugins.acp.session import AcpSession

log = logging.getLogger(__name__)
STOP_REASONS = {names.FINISHED: "end_turn", names.CANCELLED: "cancelled",
                names.BUDGET_EXHAUSTED: "max_turn_requests"}
MODE_TEXT = {"ask": ("Ask", "Ask before every command, file change and external tool"),
             "auto-edit": ("Auto-edit", "File changes run at once; commands and external "
                                        "tools ask"),
             "full-auto": ("Full auto", "Nothing asks (commands still run in the sandbox)")}
RATE_COMMANDS = {"good": 1, "bad": -1}


@dataclass
class AcpConfig:
    policy_spec: str = "default"               # --policy or --model: what load_policy gets
    max_steps: int = 50                        # model calls per prompt before it stops
    approval: str = "ask"                      # the initial session mode (an approval mode)
    context_window: int | None = None          # override of the policy's window (tokens)
    max_message_bytes: int = 16 * 2**20        # larger incoming messages get an error, unread
    connect: str | None = None                 # version server to follow (new weights)
    token: str = ""                            # its bearer token


class ApprenticeAgent:
    """The ACP `Agent`: sessions by id, one policy for all of them, one store."""

    def __init__(self, config: AcpConfig, store: Any):
        self.config, self.store = config, store
        self.conn: Any = None
        self.sessions: dict[str, AcpSession] = {}
        self.client_reads = self.client_writes = False
        self._policy: Any = None

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    def policy(self) -> Any:
        if self._policy is None:
            from agent_runtime.policies import load_policy
            try:
                self._policy = load_policy(self.config.policy_spec)
            except (OSError, ValueError) as exc:
                raise RequestError.internal_error(
                    {"details": f"cannot load policy {self.config.policy_spec!r}: {exc}"})
            if self.config.context_window:
                self._policy.context_window = self.config.context_window
            if self.config.connect:
                from agent_runtime.subscriber import follow
                self._policy, _ = follow(self._policy, self.config.connect, self.config.token,
                                         self.store)
        return self._policy

    # -- lifecycle -------------------------------------------------------------------------

    async def initialize(self, protocol_version: int, client_capabilities: Any = None,
                         client_info: Any = None, **kwargs: Any) -> InitializeResponse:
        fs = getattr(client_capabilities, "fs", None)
        self.client_reads = bool(fs and fs.read_text_file)
        self.client_writes = bool(fs and fs.write_text_file)
        return InitializeResponse(
            protocol_version=min(protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(
                load_session=True,
                prompt_capabilities=PromptCapabilities(image=False, audio=False,
                                                       embedded_context=True),
                mcp_capabilities=McpCapabilities(http=False, sse=False)),
            agent_info=Implementation(name="apprentice", title="apprentice", version=_version()),
            auth_methods=[])

    async def authenticate(self, method_id: str, **kwargs: Any) -> None:
        return None                            # local: nothing to authenticate

    async def new_session(self, cwd: str, mcp_servers: list | None = None,
                          **kwargs: Any) -> NewSessionResponse:
        session = await self._open(uuid.uuid4().hex, cwd, mcp_servers, started=False)
        self._after_response(self._announce(session))
        return NewSessionResponse(session_id=session.id, modes=self._modes(session))

    async def load_session(self, cwd: str, session_id: str, mcp_servers: list | None = None,
                           **kwargs: Any) -> LoadSessionResponse:
        try:
            record = self.store.get_session(session_id)
        except KeyError:
            record = None
        if record is None or record["id"] != session_id:
            raise RequestError.invalid_params({"details": f"unknown session id {session_id!r}"})
        session = await self._open(session_id, cwd, mcp_servers, started=True)
        await replay_history(self.conn, self.store, session)
        self._after_response(self._announce(session))
        return LoadSessionResponse(modes=self._modes(session))

    async def set_session_mode(self, session_id: str, mode_id: str,
                               **kwargs: Any) -> SetSessionModeResponse:
        session = self._session(session_id)
        if mode_id not in MODES:
            raise RequestError.invalid_params(
                {"details": f"unknown mode {mode_id!r}; modes: {', '.join(MODES)}"})
        session.gate.mode = mode_id
        return SetSessionModeResponse()

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.cancel()

    # -- prompts ---------------------------------------------------------------------------

    async def prompt(self, session_id: str, prompt: list, **kwargs: Any) -> PromptResponse:
        session = self._session(session_id)
        text = prompt_text(prompt)
        if not text.strip():
            raise RequestError.invalid_params({"details": "the prompt has no text"})
        word, _, rest = text.strip().partition(" ")
        if word[1:] in RATE_COMMANDS and word.startswith("/"):
            await self._rate(session, word[1:], rest.strip())
            return PromptResponse(stop_reason="end_turn")
        if not session.running.acquire(blocking=False):
            raise RequestError.invalid_request(
                {"details": "this session is already running a prompt; cancel it first"})
        try:
            result = await asyncio.to_thread(session.run, text)
        finally:
            session.running.release()
        if result.status == names.FINISHED and result.summary:
            await self._say(session, result.summary)
        elif result.status == names.FAILED:
            await self._say(session, f"The run failed: {result.summary}")
        elif result.status == names.BUDGET_EXHAUSTED:
            await self._say(session, f"Stopped: {result.summary}. Send another prompt to go on.")
        return PromptResponse(stop_reason=STOP_REASONS.get(result.status, "end_turn"))

    async def _rate(self, session: AcpSession, command: str, rest: str) -> None:
        """`/good` or `/bad [reason] [comment]`: feedback on the latest agent turn."""
        from agent_runtime.store import FEEDBACK_REASONS
        message_id = None
        if session.started:
            assistant = [m for m in self.store.messages(session.id) if m["role"] == "assistant"]
            message_id = assistant[-1]["id"] if assistant else None
        if message_id is None:
            await self._say(session, "Nothing to rate yet: no agent turn in this session.")
            return
        reason, _, comment = rest.partition(" ")
        if reason not in FEEDBACK_REASONS:
            reason, comment = None, rest
        self.store.add_feedback(RATE_COMMANDS[command], session_id=session.id,
                                message_id=message_id, reason=reason,
                                comment=comment.strip() or None)
        await self._say(session, f"Recorded {'👍' if command == 'good' else '👎'} for the last "
                                 "turn. Thank you: apprentice learns from it.")

    # -- helpers ---------------------------------------------------------------------------

    async def _open(self, session_id: str, cwd: str, mcp_servers: list | None,
                    started: bool) -> AcpSession:
        workspace = Path(cwd)
        if not workspace.is_absolute() or not workspace.is_dir():
            raise RequestError.invalid_params(
                {"details": f"cwd must be an absolute path to an existing folder, got {cwd!r}"})
        workspace = workspace.resolve()
        tools = await asyncio.to_thread(_session_tools, workspace, mcp_servers or [])
        session = AcpSession(session_id, workspace, self.conn, asyncio.get_running_loop(),
                             self.store, self.policy(), tools, mode=self.config.approval,
                             max_steps=self.config.max_steps, client_reads=self.client_reads,
                             client_writes=self.client_writes, started=started)
        old = self.sessions.get(session_id)
        if old is not None:
            old.cancel()
        self.sessions[session_id] = session
        return session

    def _session(self, session_id: str) -> AcpSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError.invalid_params(
                {"details": f"unknown session id {session_id!r}; create one with session/new "
                            "or load it with session/load"})
        return session

    def _modes(self, session: AcpSession) -> SessionModeState:
        return SessionModeState(current_mode_id=session.gate.mode, available_modes=[
            SessionMode(id=m, name=MODE_TEXT[m][0], description=MODE_TEXT[m][1]) for m in MODES])

    async def _announce(self, session: AcpSession) -> None:
        hint = AvailableCommandInput(root=UnstructuredCommandInput(hint="[reason] [comment]"))
        await self.conn.session_update(session_id=session.id, update=helpers.update_available_commands([
            AvailableCommand(name="good", description="Rate the last agent turn up", input=hint),
            AvailableCommand(name="bad", description="Rate the last agent turn down (reasons: "
                             "misunderstood, wrong_change, unnecessary_change, should_ask, "
                             "incomplete, other)", input=hint)]))

    def _after_response(self, coro: Any) -> None:
        """Send `coro`'s notifications once the current request has been answered."""
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or log.warning("notification failed: %s", t.exception()))

    async def _say(self, session: AcpSession, text: str) -> None:
        await self.conn.session_update(session_id=session.id,
                                       update=helpers.update_agent_message_text(text))


def prompt_text(blocks: list) -> str:
    """The prompt's content blocks as one user message (text, links, embedded files)."""
    parts = []
    for block in blocks:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource_link":
            parts.append(f"@{block.uri}")
        elif kind == "resource" and getattr(block.resource, "text", None) is not None:
            parts.append(f"Context from {block.resource.uri}:\n```\n{block.resource.text}\n```")
    return "\n\n".join(parts)


def _session_tools(workspace: Path, mcp_servers: list) -> list[Any]:
    """The plugins' tools for `workspace` and those of the editor's stdio MCP servers."""
    from plugins.mcp_client import McpServerConfig, hub
    tools = plugin_tools(workspace)
    for server in mcp_servers:
        if getattr(server, "command", None) is None:
            log.warning("MCP server %s ignored: only stdio servers are supported",
                        getattr(server, "name", "?"))
            continue
        config = McpServerConfig(server.name, server.command, list(server.args),
                                 {e.name: e.value for e in server.env or []})
        tools += hub().tools(config, workspace)
    return list({t.name: t for t in tools}.values())   # a later tool of the same name wins


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("apprentice")
    except PackageNotFoundError:
        return "0"
