"""Crash safety: an agent run SIGKILLed at random points leaves a consistent, resumable store.

A forked child runs the replay policy (with a small delay per model call, so kills land
everywhere: in generation, in tool calls, in store writes) and is killed at a random moment
of its run; the parent checks the database and resumes the session to the end.
"""

import json
import os
import random
import shutil
import signal
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest

from agent_runtime.agent import Agent
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore
from agent_runtime.tools.registry import default_tools

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calc"
TRIALS = 20


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = [
    call("read_file", path="calc.py") + call("read_file", path="test_calc.py"),
    call("edit_file", path="calc.py", old="return a - b", new="return a + b"),
    call("write_file", path="NOTES.md", content="fixed add\n") + call("list_files"),
    call("run_command", command="python3 test_calc.py"),
    call("grep", pattern="def "),
    call("finish", summary="fixed"),
]


def run_child(root: Path, delay: float) -> int:
    pid = os.fork()
    if pid == 0:                                        # child: run the agent, never return
        try:
            tempfile.tempdir = str(root / "tmp")
            store = SessionStore(root / "home")
            Agent(ReplayPolicy(SCRIPT, delay=delay), default_tools(), store,
                  root / "ws").run("Fix the failing test")
        finally:
            os._exit(0)
    return pid


def fresh(root: Path) -> Path:
    shutil.copytree(EXAMPLE, root / "ws")
    (root / "tmp").mkdir()
    return root


def check_consistent(home: Path) -> list[str]:
    """Assert the invariants the loop promises; returns the session ids."""
    conn = sqlite3.connect(home / "apprentice.db")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    conn.close()
    with SessionStore(home) as store:
        sessions = [s["id"] for s in store.list_sessions()]
        for sid in sessions:
            messages = store.messages(sid)
            assert [m["idx"] for m in messages] == list(range(len(messages)))
            answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
            rows = store.tool_calls(sid)
            for row in rows:                             # a result exactly when a tool message
                assert (row["result"] is not None) == (row["call_id"] in answered)
            assert answered <= {r["call_id"] for r in rows}
            assistant = {m["id"] for m in messages if m["role"] == "assistant"}
            sampled = [s["message_id"] for s in store.samples(sid)]
            assert sorted(sampled) == sorted(assistant)  # one sample per assistant message
    return sessions


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_at_random_points_leaves_a_consistent_resumable_session(tmp_path):
    delay = 0.04
    ReplayPolicy([])                                     # import the tokenizer once, before forking
    root = fresh(tmp_path / "full")
    start = time.perf_counter()
    os.waitpid(run_child(root, delay), 0)
    full = time.perf_counter() - start                   # one uninterrupted run
    (sid,) = check_consistent(root / "home")
    with SessionStore(root / "home") as store:
        assert store.get_session(sid)["status"] == "finished"

    rng, resumed = random.Random(1234), 0
    for trial in range(TRIALS):
        root = fresh(tmp_path / f"t{trial}")
        pid = run_child(root, delay)
        time.sleep(rng.uniform(0.0, full))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        sessions = check_consistent(root / "home") if (root / "home").exists() else []
        for sid in sessions:
            with SessionStore(root / "home") as store:
                before = len(store.messages(sid))
                result = Agent(ReplayPolicy([call("finish", summary="resumed")]), default_tools(),
                               store, root / "ws").resume(sid)
                assert (result.session_id, result.status) == (sid, "finished")
                assert len(store.messages(sid)) > before
            check_consistent(root / "home")
            with SessionStore(root / "home") as store:
                assert all(r["result"] is not None for r in store.tool_calls(sid))
            resumed += 1
    assert resumed >= TRIALS // 2                        # most kills landed after the session began
