"""An example apprentice plugin: a `line_count` tool (lines of text per file extension).

A plugin is a module with pluggy hook implementations, named in the `apprentice` entry-point
group of its package (see pyproject.toml next to this file). This one implements
`register_tools`; `register_commands` (click commands) and `register_feedback_sources` work
the same way. It uses only apprentice's public tool API and changes nothing in apprentice.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from agent_runtime.hooks import hookimpl
from agent_runtime.tools import ToolContext, ToolError, ToolResult
from agent_runtime.tools import paths


class LineCount:
    name = "line_count"
    description = ("Count the lines of text files under a folder of the workspace, per file "
                   "extension (ignored files skipped). Use it to size up a codebase.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "Folder relative to the workspace root "
                                                      "(default: the root)."},
        },
    }
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        start = paths.resolve(ctx.workspace, args.get("path") or ".", tool=self.name)
        if not start.exists():
            raise ToolError(f"line_count: `{args.get('path')}` does not exist")
        lines: Counter[str] = Counter()
        for file in paths.walk(ctx.workspace, start):
            data = file.read_bytes()
            if not paths.is_binary(data[:8192]):
                lines[file.suffix or "(none)"] += data.count(b"\n")
        rows = [f"{ext}\t{n}" for ext, n in lines.most_common()]
        return ToolResult("\n".join(rows) or "(no text files)", {"lines": dict(lines)})


@hookimpl
def register_tools(register):
    register(LineCount())
