"""`finish`: the model's way to say the task is done. The loop ends on its name; the tool
only hands the summary back. It checks nothing (tests, diffs): that is the loop's business."""

from __future__ import annotations

from typing import Any

from agent_runtime.tools.base import ToolContext, ToolResult


class Finish:
    name = "finish"
    description = ("Call when the task is complete (or cannot be completed): give a short "
                   "summary of what you did and anything the user should know.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "description": "What was done, for the user."},
        },
        "required": ["summary"],
    }
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        summary = args["summary"].strip()
        return ToolResult(summary, {"summary": summary})
