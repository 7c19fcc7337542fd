"""Helpers for the plugin tests: replay scripts, the MCP test server, subprocess environments."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
MCP_TEST_SERVER = HERE / "mcp_test_server.py"


def call(name: str, **arguments) -> str:
    """One assistant turn that calls `name` (the Hermes `<tool_call>` convention)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def write_script(path: Path, turns: list[str]) -> Path:
    path.write_text(json.dumps(turns), encoding="utf-8")
    return path


def subprocess_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for an `apprentice` subprocess: this checkout first on the path."""
    env = dict(os.environ, APPRENTICE_HOME=str(home), OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def apprentice_command() -> list[str]:
    return [sys.executable, "-m", "agent_runtime.cli"]


class RecordingClient:
    """An ACP client (for `acp.spawn_agent_process`) that records every session update,
    answers permission requests from a list (`allow_once`, `reject_once`, ... or `cancel`:
    the test cancels the turn, then answers `cancelled` as the protocol says), and serves
    fs/* from an in-memory set of editor buffers when `buffers` is given."""

    def __init__(self, answers: list[str] | None = None, buffers: dict | None = None):
        self.updates: list = []
        self.permission_requests: list = []
        self.answers = list(answers or [])
        self.buffers = buffers
        self.writes: list[tuple[str, str]] = []
        self.conn = None

    def capabilities(self):
        from acp.schema import ClientCapabilities, FileSystemCapabilities
        offered = self.buffers is not None
        return ClientCapabilities(fs=FileSystemCapabilities(read_text_file=offered,
                                                            write_text_file=offered))

    async def session_update(self, session_id, update, **kwargs):
        self.updates.append(update)

    async def request_permission(self, session_id, tool_call, options, **kwargs):
        from acp import RequestPermissionResponse
        from acp.schema import AllowedOutcome, DeniedOutcome
        self.permission_requests.append(tool_call)
        answer = self.answers.pop(0) if self.answers else "reject_once"
        if answer == "cancel":
            await self.conn.cancel(session_id=session_id)
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        option = next(o for o in options if o.kind == answer)
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected",
                                                                option_id=option.option_id))

    async def read_text_file(self, session_id, path, line=None, limit=None, **kwargs):
        from acp import ReadTextFileResponse
        from acp.exceptions import RequestError
        if path not in self.buffers:
            raise RequestError.resource_not_found(path)
        return ReadTextFileResponse(content=self.buffers[path])

    async def write_text_file(self, session_id, path, content, **kwargs):
        from acp import WriteTextFileResponse
        self.buffers[path] = content
        self.writes.append((path, content))
        return WriteTextFileResponse()

    def kinds(self) -> list[str]:
        return [u.session_update for u in self.updates]

    def text(self, kind: str = "agent_message_chunk") -> str:
        return "".join(u.content.text for u in self.updates if u.session_update == kind)


class LinePeer:
    """A JSON-lines server process on pipes (`apprentice acp`, `apprentice mcp`), spoken to
    one line at a time: `send` writes a line and returns the next message it answers."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(json.loads(line))

    def send(self, raw: bytes | str) -> dict:
        self.process.stdin.write(raw.encode() if isinstance(raw, str) else raw)
        self.process.stdin.write(b"\n")
        self.process.stdin.flush()
        return self.lines.get(timeout=60)

    def request(self, request_id, method, params) -> dict:
        return self.send(json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method,
                                     "params": params}))

    def notify(self, method, params=None) -> None:
        self.process.stdin.write(json.dumps({"jsonrpc": "2.0", "method": method,
                                             **({"params": params} if params else {})}).encode()
                                 + b"\n")
        self.process.stdin.flush()

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)
