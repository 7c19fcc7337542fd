"""Approvals: ask the user before the agent runs commands or changes files.

The agent loop has no approval hook, so approval happens inside the tools: `GatedTool` wraps
a tool and, when the `ApprovalGate` says the call needs the user's consent, blocks the agent's
worker thread until the front end (the TUI, an ACP editor) answers. A refusal raises `ToolError`, so the model reads that the
user declined and can change course; a cancelled session releases a waiting call the same way.

Modes, as in the coding agents people know:
- `ask`: ask before every command, every file write or edit, and every external tool;
- `auto-edit`: file writes and edits run at once, commands and external tools still ask;
- `full-auto`: nothing asks.
External tools are those that set `needs_approval = True` (MCP servers' tools): their effects
are unknown, so they are treated like commands.
Without a sandbox (bubblewrap missing or failing under the default `APPRENTICE_SANDBOX=auto`)
commands run with the user's own permissions, so they ask in every mode, `full-auto`
included, as Codex does when it cannot sandbox; "always allow" rules for an exact command
still hold. Setting `APPRENTICE_SANDBOX=off` is the explicit opt-out: then the mode decides.
"Always allow" answers persist per workspace in `$APPRENTICE_HOME/approvals.json`:
edits as a whole, commands by their exact command line, external tools by name.

This module knows no front end; the TUI or the ACP server hands the gate an `ask` function.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agent_runtime.names import DECLINED_PREFIX, PERMISSION_REJECTED
from agent_runtime.tools.base import Tool, ToolContext, ToolError, ToolResult

MODES = ("ask", "auto-edit", "full-auto")
EDIT_TOOLS = frozenset({"write_file", "edit_file"})
COMMAND_TOOLS = frozenset({"run_command"})
YES, ALWAYS, NO = "yes", "always", "no"
REJECTED_SOURCE = PERMISSION_REJECTED          # feedback source: the user declined a tool call
LISTED_RULES = {"command": "commands",          # rule kind -> its list in approvals.json
                "tool": "tools",
                "mcp_server": "mcp_servers"}    # a workspace .mcp.json server the user trusts


@dataclass
class Request:
    """One tool call waiting for the user's answer."""
    tool: str                                  # tool name
    arguments: dict[str, Any]                  # the call's arguments, as the model wrote them
    rule: str                                  # what "always allow" remembers: "edits",
                                               # "command:<line>" or "tool:<name>"
    unconfined: bool = False                   # a command that would run without a sandbox

    @property
    def always_label(self) -> str:
        if self.rule == "edits":
            return "always allow file edits in this workspace"
        if self.rule.startswith("tool:"):
            return f"always allow {self.tool} in this workspace"
        return "always allow this exact command in this workspace"


class ApprovalStore:
    """`approvals.json`: {resolved workspace path: {"edits": bool, "commands": [line, ...],
    "tools": [name, ...], "mcp_servers": [name@fingerprint, ...]}}."""

    def __init__(self, home: str | Path):
        self.path = Path(home) / "approvals.json"
        self._lock = threading.Lock()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def rules(self, workspace: str | Path) -> set[str]:
        entry = self._read().get(str(Path(workspace).resolve())) or {}
        rules = {f"{kind}:{value}" for kind, key in LISTED_RULES.items()
                 for value in entry.get(key) or [] if isinstance(value, str)}
        if entry.get("edits"):
            rules.add("edits")
        return rules

    def allow(self, workspace: str | Path, rule: str) -> None:
        """Remember `rule` for `workspace` (read-modify-write, replaced atomically)."""
        with self._lock:
            data = self._read()
            entry = data.setdefault(str(Path(workspace).resolve()), {})
            if rule == "edits":
                entry["edits"] = True
            else:
                kind, _, value = rule.partition(":")
                listed = entry.setdefault(LISTED_RULES[kind], [])
                if value not in listed:
                    listed.append(value)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, self.path)


class ApprovalGate:
    """Decides which calls need consent and waits for it (on the agent's thread)."""

    def __init__(self, store: ApprovalStore, workspace: str | Path, mode: str = "ask",
                 ask: Callable[[Request, Callable[[str | None], None]], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"approval mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.store, self.mode, self.ask = store, mode, ask
        self.workspace = Path(workspace).resolve()
        self.allowed = store.rules(self.workspace)
        self.cancel_event = threading.Event()  # set by the agent's cancel: stop waiting

    def request_for(self, name: str, arguments: dict[str, Any], tool: Tool | None = None,
                    unconfined: bool = False) -> Request | None:
        """The request to put to the user, or None when the call may run as it is;
        `unconfined`: commands would run without a sandbox (they ask in every mode)."""
        if name in EDIT_TOOLS:
            if self.mode in ("auto-edit", "full-auto") or "edits" in self.allowed:
                return None
            return Request(name, arguments, "edits")
        if name in COMMAND_TOOLS:
            rule = f"command:{arguments.get('command', '')}"
            if (self.mode == "full-auto" and not unconfined) or rule in self.allowed:
                return None
            return Request(name, arguments, rule, unconfined)
        if needs_approval(tool):
            rule = f"tool:{name}"
            if self.mode == "full-auto" or rule in self.allowed:
                return None
            return Request(name, arguments, rule)
        return None

    def check(self, name: str, arguments: dict[str, Any], tool: Tool | None = None,
              unconfined: bool = False) -> None:
        """Return when the call may run; raise `ToolError` when the user said no."""
        request = self.request_for(name, arguments, tool, unconfined)
        if request is None:
            return
        if self.cancel_event.is_set():
            raise ToolError("Not run: the user cancelled the session before this call.")
        if self.ask is None:
            raise ToolError(f"Not run: {name} needs the user's approval and nobody can give it.")
        answered = threading.Event()
        answer: list[str | None] = [None]

        def reply(value: str | None) -> None:
            answer[0] = value
            answered.set()

        self.ask(request, reply)
        while not answered.wait(0.05) or self.cancel_event.is_set():
            if self.cancel_event.is_set():
                raise ToolError("Not run: the user cancelled the session before approving "
                                "this call.")
        if answer[0] == ALWAYS:
            self.allowed.add(request.rule)
            self.store.allow(self.workspace, request.rule)
        elif answer[0] != YES:
            raise ToolError(f"{DECLINED_PREFIX} this {name} call. Do not repeat it "
                            "unchanged; try another way, or call finish and say what you "
                            "need from the user.")


class GatedTool:
    """A tool that asks the gate before it runs; otherwise the same tool."""

    def __init__(self, tool: Tool, gate: ApprovalGate):
        self.tool, self.gate = tool, gate
        self.name, self.description = tool.name, tool.description
        self.parameters, self.mutates = tool.parameters, tool.mutates

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.gate.check(self.name, args, self.tool, runs_unconfined(ctx))
        return self.tool(args, ctx)


def runs_unconfined(ctx: ToolContext) -> bool:
    """Whether commands of this context would run without a sandbox that the user did not
    switch off themselves (`APPRENTICE_SANDBOX=auto` and bubblewrap unavailable)."""
    sandbox = ctx.sandbox
    return sandbox is not None and sandbox.config.mode == "auto" and not sandbox.probe()


def needs_approval(tool: Tool | None) -> bool:
    """Whether `tool` is an external tool that asks like a command (`needs_approval = True`)."""
    return bool(getattr(tool, "needs_approval", False))


def gated(tools: list[Tool], gate: ApprovalGate) -> list[Tool]:
    """Wrap the tools that can need approval; the rest pass through unchanged."""
    return [GatedTool(t, gate) if t.name in EDIT_TOOLS | COMMAND_TOOLS or needs_approval(t)
            else t for t in tools]
