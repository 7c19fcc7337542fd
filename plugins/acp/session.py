"""One ACP session: an apprentice agent whose events become ACP session updates.

The agent loop runs on a worker thread; everything it reports (streamed text, tool calls,
results) is sent to the editor through the connection's event loop, in order, before the
prompt's answer. Tools are wrapped (`EditorTool`) so that a call
- asks `session/request_permission` when the approval mode says so (`ApprovalGate`), and a
  rejection is recorded in the store as implicit feedback (source `permission_rejected`);
- reads and writes files through the editor (`fs/read_text_file`, `fs/write_text_file`) when
  the client offers them, so unsaved buffers are what the agent sees and changes;
- reports edits as `diff` content (whole old and new text, as ACP wants) and commands with
  their output.
Nothing here parses JSON-RPC or chooses stop reasons; `server.py` does.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from acp import helpers
from acp.schema import PermissionOption, ToolCallLocation, ToolCallUpdate

from agent_runtime.agent import Agent, AgentConfig, Callbacks, RunResult
from agent_runtime.approvals import (ALWAYS, COMMAND_TOOLS, EDIT_TOOLS, NO, REJECTED_SOURCE,
                                     YES, ApprovalGate, ApprovalStore, Request, runs_unconfined)
from agent_runtime.learning import session_learns
from agent_runtime.toolcalls import visible_text
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult
from agent_runtime.tools.files import DiskFiles
from agent_runtime.tools.paths import resolve

KINDS = {"read_file": "read", "write_file": "edit", "edit_file": "edit", "list_files": "search",
         "grep": "search", "semantic_search": "search", "run_command": "execute",
         "finish": "think"}
OPTIONS = [PermissionOption(option_id=YES, name="Allow", kind="allow_once"),
           PermissionOption(option_id=ALWAYS, name="Always allow", kind="allow_always"),
           PermissionOption(option_id=NO, name="Reject", kind="reject_once")]
OUTPUT_CHARS = 20_000                          # command output shown in the editor


def tool_kind(name: str | None) -> str:
    return KINDS.get(name or "", "other")


def tool_title(name: str | None, args: dict | None) -> str:
    args = args or {}
    if name == "run_command":
        return f"`{args.get('command', '')}`"
    if name in ("read_file", "write_file", "edit_file") and args.get("path"):
        return f"{name.replace('_', ' ')} {args['path']}"
    if name in ("grep", "semantic_search") and args.get("pattern" if name == "grep" else "query"):
        return f"{name.replace('_', ' ')} {args.get('pattern') or args.get('query')}"
    return name or "invalid tool call"


def result_content(name: str | None, text: str, diffs: list[tuple[str, str | None, str]]) -> list:
    """ACP tool-call content: diffs for edits, fenced output for commands, text otherwise."""
    if diffs:
        return [helpers.tool_diff_content(path, new, old) for path, old, new in diffs]
    if name == "run_command":
        if len(text) > OUTPUT_CHARS:
            text = text[:OUTPUT_CHARS // 2] + "\n…\n" + text[-OUTPUT_CHARS // 2:]
        return [helpers.tool_content(helpers.text_block(f"```\n{text.rstrip()}\n```"))]
    return [helpers.tool_content(helpers.text_block(text))]


class EditorFiles:
    """A `FileAccess` through the editor's fs methods where offered (disk otherwise), that
    remembers the text before and after each write for the diff."""

    def __init__(self, session: "AcpSession"):
        self.session = session
        self.disk = DiskFiles()
        self.before: dict[Path, str | None] = {}
        self.after: dict[Path, str] = {}

    def read_text(self, path: Path) -> str:
        if self.session.client_reads:
            try:
                response = self.session.call(self.session.conn.read_text_file(
                    session_id=self.session.id, path=str(path)))
                text = response.content
            except Exception as exc:            # the editor refused or failed: say so
                raise OSError(f"the editor could not read it ({exc})") from None
        else:
            text = self.disk.read_text(path)
        self.before.setdefault(path, text)
        return text

    def write_text(self, path: Path, content: str) -> None:
        self.before.setdefault(path, None)
        if self.session.client_writes:
            try:
                self.session.call(self.session.conn.write_text_file(
                    session_id=self.session.id, path=str(path), content=content))
            except Exception as exc:
                raise OSError(f"the editor could not write it ({exc})") from None
        else:
            self.disk.write_text(path, content)
        self.after[path] = content

    def diffs(self) -> list[tuple[str, str | None, str]]:
        return [(str(p), self.before.get(p), new) for p, new in self.after.items()]


class EditorTool:
    """A tool as the editor sees it: permission first, files through the editor."""

    def __init__(self, tool: Any, session: "AcpSession"):
        self.tool, self.session = tool, session
        self.name, self.description = tool.name, tool.description
        self.parameters, self.mutates = tool.parameters, tool.mutates
        self.needs_approval = getattr(tool, "needs_approval", False)

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        session = self.session
        call_id = session.call_ids.get(id(args), "")
        try:
            session.gate.check(self.name, args, self.tool, runs_unconfined(ctx))
        except ToolError:
            if session.answers.pop(call_id, None) == NO:
                session.record_rejection(self.name, args)
            raise
        session.update(helpers.update_tool_call(call_id, status="in_progress"))
        files = EditorFiles(session)
        result = self.tool(args, replace(ctx, extras={**ctx.extras, "files": files}))
        session.diffs[call_id] = files.diffs()
        return result


class AcpSession:
    """The bridge between one apprentice agent (worker thread) and the ACP connection."""

    def __init__(self, session_id: str, workspace: Path, conn: Any, loop: asyncio.AbstractEventLoop,
                 store: Any, policy: Any, tools: list[Any], *, mode: str, max_steps: int,
                 client_reads: bool, client_writes: bool, started: bool):
        self.id, self.workspace, self.conn, self.loop = session_id, workspace, conn, loop
        self.store, self.policy, self.max_steps = store, policy, max_steps
        self.client_reads, self.client_writes = client_reads, client_writes
        self.started = started                 # the store has this session (a prompt ran)
        self.gate = ApprovalGate(ApprovalStore(store.home), workspace, mode, ask=self._ask)
        self.tools = [EditorTool(t, self) for t in tools]
        self.call_ids: dict[int, str] = {}     # id(arguments dict) -> tool call id
        self.answers: dict[str, str | None] = {}  # tool call id -> the user's answer
        self.diffs: dict[str, list] = {}       # tool call id -> (path, old, new) written
        self.last_assistant: int | None = None  # store id of the latest assistant message
        self.agent: Agent | None = None
        self.running = threading.Lock()
        self._raw = ""
        self._sent = 0

    # -- to the editor, from the worker thread ---------------------------------------------

    def call(self, coro: Any) -> Any:
        """Run `coro` on the connection's loop and wait for it (worker thread only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def update(self, update: Any) -> None:
        self.call(self.conn.session_update(session_id=self.id, update=update))

    def _ask(self, request: Request, reply: Any) -> None:
        """The gate's question as `session/request_permission`; the answer arrives later."""
        call_id = self.call_ids.get(id(request.arguments), "")
        content = self._preview(request)
        tool_call = ToolCallUpdate(
            tool_call_id=call_id, title=tool_title(request.tool, request.arguments),
            kind=tool_kind(request.tool), status="pending", raw_input=request.arguments,
            content=content or None, locations=self._locations(request.tool, request.arguments))
        options = [o if o.option_id != ALWAYS else o.model_copy(update={"name": request.always_label})
                   for o in OPTIONS]
        future = asyncio.run_coroutine_threadsafe(self.conn.request_permission(
            session_id=self.id, tool_call=tool_call, options=options), self.loop)

        def answered(done: Any) -> None:
            try:
                outcome = done.result().outcome
                answer = outcome.option_id if outcome.outcome == "selected" else None
                if outcome.outcome == "cancelled":
                    self.cancel()               # the protocol's answer when the turn is cancelled
            except Exception:                   # the editor failed or went away: not allowed
                answer = None
            self.answers[call_id] = answer
            reply(answer)

        future.add_done_callback(answered)

    def _preview(self, request: Request) -> list:
        """What the editor shows with the question: the diff an edit would make, or the command."""
        args = request.arguments
        if request.tool in EDIT_TOOLS:
            try:
                path = resolve(self.workspace, str(args.get("path", "")), tool=request.tool)
                old = EditorFiles(self).read_text(path) if path.is_file() else None
            except (ToolError, OSError):
                return []
            if request.tool == "write_file":
                new = str(args.get("content", ""))
            elif old is not None and args.get("old") and args["old"] in old:
                new = old.replace(args["old"], str(args.get("new", "")),
                                  -1 if args.get("replace_all") else 1)
            else:
                return []
            return [helpers.tool_diff_content(str(path), new, old)]
        if request.tool in COMMAND_TOOLS:
            note = ("\n\nNo sandbox: this command runs with your permissions."
                    if request.unconfined else "")
            return [helpers.tool_content(helpers.text_block(
                f"```\n{args.get('command', '')}\n```{note}"))]
        return []

    def _locations(self, name: str | None, args: dict | None) -> list[ToolCallLocation] | None:
        if name in ("read_file", "write_file", "edit_file") and (args or {}).get("path"):
            try:
                return [ToolCallLocation(path=str(resolve(self.workspace, str(args["path"]))))]
            except ToolError:
                return None
        return None

    def record_rejection(self, tool: str, args: dict) -> None:
        """A declined call is a signal about the turn that proposed it."""
        if self.agent is None or self.agent.session_id is None:
            return
        shown = args.get("command") or args.get("path") or ""
        self.store.add_feedback(-1, session_id=self.agent.session_id,
                                message_id=self.last_assistant, source=REJECTED_SOURCE,
                                comment=f"the user rejected {tool} {shown}".rstrip())

    # -- agent callbacks (worker thread) ---------------------------------------------------

    def callbacks(self) -> Callbacks:
        return Callbacks(on_text=self._on_text, on_message=self._on_message,
                         on_tool_start=self._on_tool_start, on_tool_end=self._on_tool_end)

    def _on_text(self, text: str) -> None:
        self._raw += text
        visible = visible_text(self._raw)
        if len(visible) > self._sent:
            self.update(helpers.update_agent_message_text(visible[self._sent:]))
            self._sent = len(visible)

    def _on_message(self, message_id: int, message: dict) -> None:
        if message["role"] == "assistant":
            self.last_assistant = message_id
            if self._sent:
                self.update(helpers.update_agent_message_text("\n\n"))
            self._raw, self._sent = "", 0

    def _on_tool_start(self, call: Any) -> None:
        if call.arguments is not None:
            self.call_ids[id(call.arguments)] = call.id
        self.update(helpers.start_tool_call(
            call.id, tool_title(call.name, call.arguments), kind=tool_kind(call.name),
            status="pending", raw_input=call.arguments if call.arguments is not None else call.raw,
            locations=self._locations(call.name, call.arguments)))

    def _on_tool_end(self, call: Any, outcome: Any) -> None:
        diffs = self.diffs.pop(call.id, [])
        self.update(helpers.update_tool_call(
            call.id, status="completed" if outcome.ok else "failed",
            content=result_content(call.name, outcome.text, diffs if outcome.ok else []),
            raw_output={"ok": outcome.ok, "text": outcome.text,
                        **{k: v for k, v in outcome.data.items() if k in ("exit_code", "timed_out")}}))
        if call.arguments is not None:
            self.call_ids.pop(id(call.arguments), None)

    # -- one prompt ------------------------------------------------------------------------

    def run(self, text: str) -> RunResult:
        """One prompt to its end (worker thread): a new session first, a resumed one after."""
        learn = session_learns(self.store.home, self.workspace)   # the workspace's opt-out
        self.agent = Agent(self.policy, tools=self.tools, store=self.store,
                           workspace=self.workspace,
                           config=AgentConfig(max_steps=self.max_steps, learn=learn),
                           callbacks=self.callbacks(), cancel_event=self.gate.cancel_event)
        self._raw, self._sent = "", 0
        if self.started:
            return self.agent.resume(self.id, message=text)
        self.started = True
        return self.agent.run(text, session_id=self.id)

    def cancel(self) -> None:
        self.gate.cancel_event.set()
