"""`session/load`: a stored session streamed back to the editor as ACP session updates.

What the user saw live comes back in order: their prompts (the task, later messages), the
agent's visible text, each tool call with its final status and result (edits as the stored
unified diff, commands with their output), and `finish`'s summary. Nudges, summary requests
and summaries (the agent's own bookkeeping) are left out, and so is the copy of the latest
prompt that a new segment carries over. Nothing is written to the store.
"""

from __future__ import annotations

from typing import Any

from acp import helpers

from agent_runtime import names
from agent_runtime.context import SUMMARY_REQUEST
from agent_runtime.toolcalls import visible_text
from plugins.acp.session import result_content, tool_kind, tool_title

HIDDEN_KINDS = {names.KIND_NUDGE, names.KIND_SUMMARY, SUMMARY_REQUEST}


def history_updates(store: Any, session_id: str) -> list[Any]:
    """The session updates that replay `session_id`, in order."""
    calls: dict[int, list[dict]] = {}
    for row in store.tool_calls(session_id):
        calls.setdefault(row["message_id"], []).append(row)
    updates: list[Any] = []
    last_user, segment = None, 0
    for m in store.messages(session_id):
        kind = (m["meta"] or {}).get("kind")
        carried = m["segment"] != segment and m["role"] == "user" and m["content"] == last_user
        segment = m["segment"]
        if m["role"] == "system" or kind in HIDDEN_KINDS or carried:
            continue                           # a summary carries the latest prompt over: once
        if m["role"] == "user":
            last_user = m["content"]
            updates.append(helpers.update_user_message_text(m["content"]))
        elif m["role"] == "assistant":
            text = visible_text(m["content"] or "")
            if text:
                updates.append(helpers.update_agent_message_text(text))
            for row in calls.get(m["id"], []):
                updates += _tool_call(row)
    return updates


def _tool_call(row: dict) -> list[Any]:
    args = row["arguments"] if isinstance(row["arguments"], dict) else None
    status = {True: "completed", False: "failed", None: "failed"}[row["ok"]]
    text = row["result"] if row["result"] is not None else "(the call did not finish)"
    diff = (row["data"] or {}).get("diff") if row["ok"] else None
    content = ([helpers.tool_content(helpers.text_block(f"```diff\n{diff}```"))] if diff
               else result_content(row["name"], text, []))
    out = [helpers.start_tool_call(row["call_id"], tool_title(row["name"], args),
                                   kind=tool_kind(row["name"]), status=status,
                                   content=content, raw_input=row["arguments"])]
    if row["name"] == "finish" and row["ok"]:
        out.append(helpers.update_agent_message_text(text))
    return out


async def replay_history(conn: Any, store: Any, session: Any) -> None:
    """Send the stored history of `session` to the editor."""
    for update in history_updates(store, session.id):
        await conn.session_update(session_id=session.id, update=update)
