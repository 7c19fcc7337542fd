"""`run_command`: run a shell command in the workspace through the session's `Sandbox`.

The tool formats the sandbox's `CommandResult` for the model: the output, then one line with
the exit code (or the timeout). Whether the command ran sandboxed is the user's business, not
the model's: a fallback warning travels in `ToolResult.data["warning"]` for the UI. When the
context carries no sandbox, one is made for the workspace on first use and kept in the
context. This module does not decide what commands are allowed; approval belongs to the loop.
"""

from __future__ import annotations

import threading
from typing import Any

from agent_runtime.sandbox import Sandbox
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult

_lock = threading.Lock()


def sandbox_for(ctx: ToolContext) -> Sandbox:
    """The context's sandbox, made (and probed) on first use."""
    with _lock:
        if ctx.sandbox is None:
            ctx.sandbox = Sandbox(ctx.workspace, session_dir=ctx.session_dir)
        sandbox = ctx.sandbox
    if not sandbox.probed:
        sandbox.probe()
    return sandbox


class RunCommand:
    name = "run_command"
    description = ("Run a shell command (bash) at the workspace root and return its output "
                   "(stdout and stderr together) and exit code. Each call starts a fresh shell: "
                   "`cd` and variables do not carry over, files do. Long output keeps its start "
                   "and end. Expect no network access.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command line, e.g. `python -m pytest -q`."},
            "timeout": {"type": "integer", "minimum": 1,
                        "description": "Seconds before the command is killed (default 120)."},
        },
        "required": ["command"],
    }
    mutates = True

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        command = args["command"]
        if not command.strip():
            raise ToolError("run_command: `command` is empty")
        sandbox = sandbox_for(ctx)
        res = sandbox.run(command, timeout=args.get("timeout"))
        text = res.output if res.output.strip() else "(no output)\n"
        if not text.endswith("\n"):
            text += "\n"
        if res.timed_out:
            limit = min(float(args.get("timeout") or sandbox.config.timeout), sandbox.config.max_timeout)
            text += (f"[timed out after {limit:g} s: the command and everything it started were "
                     "killed. Use a larger timeout, or run a smaller part]")
        else:
            text += f"[exit code: {res.exit_code}]"
        data: dict[str, Any] = {
            "exit_code": res.exit_code, "timed_out": res.timed_out, "truncated": res.truncated,
            "full_output_path": str(res.full_output_path) if res.full_output_path else None,
            "sandboxed": res.sandboxed, "duration": round(res.duration, 3),
        }
        warning = res.warning or sandbox.warning
        if warning:
            data["warning"] = warning
        return ToolResult(text, data)
