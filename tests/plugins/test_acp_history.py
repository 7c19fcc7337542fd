"""session/load's history: what a stored session replays as ACP updates."""

from __future__ import annotations

import pytest

from agent_runtime.context import SUMMARY_REQUEST
from plugins.acp.history import history_updates

EDIT_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "edit_file", "arguments": {"path": "a.py", "old": "x", "new": "y"}}}


@pytest.fixture
def stored(store):
    """A session that summarized itself once: segment 1 carries the latest prompt over."""
    sid = store.create_session("fix it", "/ws", "replay")
    add = store.add_message
    add(sid, 0, "system", "you are apprentice")
    add(sid, 0, "user", "fix it", meta={"kind": "task"})
    turn = add(sid, 0, "assistant", "Editing.", tool_calls=[EDIT_CALL])
    row = store.add_tool_call(sid, turn, "call_1", "edit_file", EDIT_CALL["function"]["arguments"])
    store.finish_tool_call(row, "Edited a.py", True, 0.1, {"diff": "--- a/a.py\n+++ b/a.py\n"})
    add(sid, 0, "tool", "Edited a.py", tool_call_id="call_1", name="edit_file")
    add(sid, 0, "user", "now the docs", meta={"kind": "user"})
    add(sid, 0, "user", "summarize", meta={"kind": SUMMARY_REQUEST})
    add(sid, 0, "assistant", "summary text", meta={"kind": "summary"})
    store.add_segment(sid, 1, "summary text")
    add(sid, 1, "user", "now the docs", meta={"kind": "user"})
    add(sid, 1, "user", "continue", meta={"kind": "nudge"})
    return store, sid


def _texts(updates, kind):
    return [u.content.text for u in updates if u.session_update == kind]


def test_user_prompts_replay_once_each(stored):
    assert _texts(history_updates(*stored), "user_message_chunk") == ["fix it", "now the docs"]


def test_agent_text_replays_without_the_summary(stored):
    assert _texts(history_updates(*stored), "agent_message_chunk") == ["Editing."]


def test_a_tool_call_replays_with_its_kind_status_and_diff(stored):
    call = [u for u in history_updates(*stored) if u.session_update == "tool_call"][0]
    assert (call.kind, call.status, "+++ b/a.py" in call.content[0].content.text) == ("edit", "completed", True)
