"""Tests for agent_runtime.store: schema migrations, blobs, validation, lookups, and crash /
concurrency safety with real SQLite files and real processes."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent_runtime import names
from agent_runtime.store import FEEDBACK_REASONS, SessionStore, blobs
from agent_runtime.store.migrations import MIGRATIONS, migrate

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


# -- schema ---------------------------------------------------------------------------------

def test_migrations_are_numbered_consecutively():
    names = [fn.__name__ for fn in MIGRATIONS]
    assert all(re.fullmatch(r"m\d{3}_[a-z0-9_]+", n) for n in names)
    assert [int(n[1:4]) for n in names] == list(range(1, len(names) + 1))


def test_reopening_applies_no_migration_twice(tmp_path):
    SessionStore(tmp_path).close()
    schema = sqlite3.connect(tmp_path / "apprentice.db").execute(
        "SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    with SessionStore(tmp_path) as s:
        assert migrate(s.db) == []
        rows = [r["name"] for r in s.db.query("SELECT name FROM _migrations ORDER BY name")]
        assert rows == [fn.__name__ for fn in MIGRATIONS]
        assert s.db.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall() \
            == schema


def test_fresh_db_opened_by_several_processes_at_once_migrates_once(tmp_path):
    start_at = str(time.time() + 1.0)
    code = """
        import sys, time
        from agent_runtime.store import SessionStore
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        with SessionStore(sys.argv[1]) as s:
            s.create_session("t", "w", "m")
    """
    procs = [run_python(code, str(tmp_path), start_at) for _ in range(4)]
    for p in procs:
        finish(p)
    with SessionStore(tmp_path) as s:
        rows = [r["name"] for r in s.db.query("SELECT name FROM _migrations")]
        assert sorted(rows) == sorted(fn.__name__ for fn in MIGRATIONS)
        assert len(s.list_sessions()) == 4


def test_database_is_in_wal_mode(store):
    conn = sqlite3.connect(store.db_path)                # journal mode persists in the file
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000


def test_home_comes_from_apprentice_home(tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_HOME", str(tmp_path / "h"))
    with SessionStore() as s:
        sid = s.create_session("t", "w", "m")
        assert s.db_path == tmp_path / "h" / "apprentice.db"
        assert s.session_dir(sid[:8]) == tmp_path / "h" / "sessions" / sid
        assert s.session_dir(sid).is_dir()


# -- blobs ----------------------------------------------------------------------------------

@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_token_ids_round_trip_as_uint32(ids):
    data = blobs.encode_ids(ids)
    assert len(data) == 4 * len(ids)
    assert blobs.decode_ids(data) == ids


@given(st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_logprobs_round_trip_as_float32(lps):
    assert blobs.decode_logprobs(blobs.encode_logprobs(lps)) == lps


route_arrays = hnp.arrays(np.int64, hnp.array_shapes(min_dims=3, max_dims=3, max_side=6),
                          elements=st.integers(0, 1023))


@given(route_arrays)
def test_routes_round_trip_uint8_below_256_experts_else_int16(routes):
    data, dtype, shape = blobs.encode_routes(routes)
    assert dtype == ("uint8" if routes.size == 0 or routes.max() < 256 else "int16")
    back = blobs.decode_routes(data, dtype, shape)
    assert back.shape == routes.shape and np.array_equal(back, routes)
    assert blobs.decode_routes(*blobs.encode_routes(routes.tolist())).tolist() == routes.tolist()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_samples_round_trip_through_the_store(store, data):
    sid = store.create_session("t", "w", "m")
    n = data.draw(st.integers(0, 40))
    prompt = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=60))
    completion = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
    lps = data.draw(st.lists(st.floats(width=32, allow_nan=False), min_size=n, max_size=n))
    layers, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    experts = data.draw(st.sampled_from([8, 256, 257, 1000]))
    routes = data.draw(hnp.arrays(np.int64, (n, layers, k), elements=st.integers(0, experts - 1)))
    forced = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n))) if n else []
    store.add_sample(sid, 0, None, prompt, completion, lps, routes, 3, "length", forced=forced)
    (got,) = store.samples(sid)
    assert (got["prompt_ids"], got["completion_ids"], got["logprobs"]) == (prompt, completion, lps)
    assert got["forced"] == forced
    assert np.array_equal(got["routes"], routes)
    assert got["routes"].dtype == (np.uint8 if routes.size == 0 or routes.max() < 256
                                   else np.int16)
    assert (got["policy_version"], got["finish_reason"], got["segment"]) == (3, "length", 0)


def test_routes_may_be_a_torch_tensor(store):
    torch = pytest.importorskip("torch")
    sid = store.create_session("t", "w", "m")
    routes = torch.randint(0, 64, (5, 3, 2))
    store.add_sample(sid, 0, None, [1], [1, 2, 3, 4, 5], torch.zeros(5), routes, 0)
    assert np.array_equal(store.samples(sid)[0]["routes"], routes.numpy())


def test_sample_needs_one_logprob_per_completion_token(store):
    sid = store.create_session("t", "w", "m")
    with pytest.raises(ValueError, match="one per token"):
        store.add_sample(sid, 0, None, [1], [2, 3], [-0.5], None, 0)
    assert store.samples(sid) == []


def test_forced_positions_must_be_completion_positions(store):
    sid = store.create_session("t", "w", "m")
    with pytest.raises(ValueError, match="outside the 2 completion tokens"):
        store.add_sample(sid, 0, None, [1], [2, 3], [-0.5, -0.5], None, 0, forced=[2])
    assert store.samples(sid) == []


# -- validation and lookups -----------------------------------------------------------------

def test_feedback_rejects_bad_rating_reason_and_foreign_message(store):
    sid, other = store.create_session("a", "w", "m"), store.create_session("b", "w", "m")
    mid = store.add_message(other, 0, "assistant", "hi")
    with pytest.raises(ValueError, match=r"rating must be \+1 or -1"):
        store.add_feedback(0, session_id=sid)
    with pytest.raises(ValueError, match="reason must be one of misunderstood"):
        store.add_feedback(-1, session_id=sid, reason="rude")
    with pytest.raises(ValueError, match=f"belongs to session {other}"):
        store.add_feedback(1, session_id=sid, message_id=mid)
    assert store.feedback() == []
    for reason in FEEDBACK_REASONS:
        store.add_feedback(-1, session_id=other, message_id=mid, reason=reason,
                           source="edit_reverted", comment="c")
    assert [f["reason"] for f in store.feedback(other)] == list(FEEDBACK_REASONS)


def test_an_explicit_rating_of_a_tool_result_or_user_message_names_the_call_to_rate(store):
    sid = store.create_session("t", "w", "m")
    opening = store.add_message(sid, 0, "user", "hello")
    call = store.add_message(sid, 0, "assistant", "reading")
    result = store.add_message(sid, 0, "tool", "ok", name="read_file")
    followup = store.add_message(sid, 0, "user", "that's wrong")
    for mid, role in ((result, "tool"), (followup, "user")):
        with pytest.raises(ValueError, match=f"#{mid} is a {role} message.* "
                                             f"assistant message #{call} before it"):
            store.add_feedback(1, session_id=sid, message_id=mid)
    with pytest.raises(ValueError, match="no assistant message comes before it"):
        store.add_feedback(1, session_id=sid, message_id=opening)
    assert store.feedback(sid) == []


def test_an_implicit_signal_may_rate_a_user_message(store):
    sid = store.create_session("t", "w", "m")
    store.add_message(sid, 0, "assistant", "done")
    followup = store.add_message(sid, 0, "user", "that's wrong")
    store.add_feedback(-1, session_id=sid, message_id=followup,
                       source=names.FOLLOWUP_DISSATISFIED)
    assert [f["message_id"] for f in store.feedback(sid)] == [followup]


def test_unique_prefix_resolves_and_ambiguous_prefix_is_a_clear_error(store):
    ids = [store.create_session(f"t{i}", "w", "m") for i in range(17)]  # 17 > 16 hex digits
    firsts = [i[0] for i in ids]
    shared = next(c for c in firsts if firsts.count(c) > 1)
    assert store.get_session(ids[3][:12])["id"] == ids[3]
    with pytest.raises(KeyError, match="ambiguous session prefix"):
        store.get_session(shared)
    with pytest.raises(KeyError, match="no session matching"):
        store.get_session("zz")


def test_messages_get_a_per_session_sequence_and_sessions_list_newest_first(store):
    a, b = store.create_session("a", "w", "m"), store.create_session("b", "w", "m")
    for i in range(3):
        store.add_message(a, 0, "user", f"a{i}")
    store.add_segment(a, 1, summary="so far")
    store.add_message(b, 0, "user", "b0")
    store.add_message(a, 1, "assistant", "a3", tool_calls=[{"name": "finish"}], meta={"x": 1})
    assert [m["idx"] for m in store.messages(a)] == [0, 1, 2, 3]
    assert [m["content"] for m in store.messages(a, segment=1)] == ["a3"]
    assert store.messages(a)[3]["tool_calls"] == [{"name": "finish"}]
    assert [s["summary"] for s in store.segments(a)] == [None, "so far"]
    assert [(s["id"], s["message_count"]) for s in store.list_sessions()] == [(b, 1), (a, 4)]


def test_a_failed_transaction_leaves_nothing_behind(store):
    sid = store.create_session("t", "w", "m")
    with pytest.raises(RuntimeError):
        with store.transaction():
            mid = store.add_message(sid, 0, "assistant", "x")
            store.add_tool_call(sid, mid, "c0", "grep", {"pattern": "x"})
            raise RuntimeError("killed mid-step")
    assert store.messages(sid) == [] and store.tool_calls(sid) == []


def test_status_and_tool_call_outcome_are_recorded(store):
    sid = store.create_session("t", "w", "m")
    mid = store.add_message(sid, 0, "assistant", "")
    tc = store.add_tool_call(sid, mid, "c0", "run_command", '{"cmd": broken')
    store.finish_tool_call(tc, "boom", False, 0.5, data={"exit": 1})
    store.set_status(sid, "failed", summary="gave up")
    with pytest.raises(ValueError, match="status must be one of"):
        store.set_status(sid, "exploded")
    (call,) = store.tool_calls(sid)
    assert (call["arguments"], call["ok"], call["data"]) == ('{"cmd": broken', False, {"exit": 1})
    assert (store.get_session(sid)["status"], store.get_session(sid)["summary"]) == \
        ("failed", "gave up")


def test_a_running_session_whose_process_died_reads_as_interrupted_until_resumed(store, tmp_path):
    proc = run_python("""
        import sys
        from agent_runtime.store import SessionStore
        print(SessionStore(sys.argv[1]).create_session("t", "w", "m"))
        """, str(tmp_path / "home"))
    sid = finish(proc).strip()                          # its process has exited: gone
    session = store.get_session(sid)
    assert (session["status"], session["pid"], session["interrupted"]) == ("running", proc.pid, True)
    assert [s["interrupted"] for s in store.list_sessions()] == [True]
    store.set_status(sid, "running")                    # a resume in this process takes it over
    session = store.get_session(sid)
    assert (session["pid"], session["interrupted"]) == (os.getpid(), False)
    store.set_status(sid, "finished")
    assert store.get_session(sid)["interrupted"] is False and store.get_session(sid)["pid"] == os.getpid()


# -- concurrency and crashes ----------------------------------------------------------------

def test_one_store_can_be_shared_by_threads(store):
    sid = store.create_session("t", "w", "m")            # e.g. TUI thread + agent worker
    workers = [threading.Thread(target=lambda: [store.add_message(sid, 0, "user", "x")
                                                for _ in range(100)]) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert [m["idx"] for m in store.messages(sid)] == list(range(200))


WRITER = """
    import sys, time
    from agent_runtime.store import SessionStore
    home, sid, name, start_at = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    with SessionStore(home) as s:
        time.sleep(max(0.0, start_at - time.time()))
        for i in range(300):
            mid = s.add_message(sid, 0, "assistant", f"{name}:{i}")
            if i % 10 == 0:
                s.add_sample(sid, 0, mid, [1, 2], [i], [-1.0], [[[i % 300]]], 0)
"""


def test_two_processes_writing_one_session_lose_nothing(store):
    sid = store.create_session("t", "w", "m")
    start_at = str(time.time() + 1.0)
    procs = [run_python(WRITER, str(store.home), sid, name, start_at) for name in "ab"]
    for p in procs:
        finish(p)
    msgs = store.messages(sid)
    assert [m["idx"] for m in msgs] == list(range(600))
    for name in "ab":
        mine = [int(m["content"].split(":")[1]) for m in msgs if m["content"][0] == name]
        assert mine == list(range(300))                   # all there, in each writer's order
    assert len(store.samples(sid)) == 60


# A forked child writes agent steps in a loop until SIGKILLed at a random moment: a third of
# the trials while it creates and migrates the database, the rest while it writes steps. One
# interpreter forks every trial, so 30 trials take about as long as their random delays.
KILLER = """
    import os, random, signal, sys, time
    import numpy as np
    from agent_runtime.store import SessionStore

    def child(home, ready):
        s = SessionStore(home)
        sid = s.create_session("t", "w", "m")
        os.write(ready, b"r")
        seg, i = 0, 0
        while True:
            with s.transaction():                         # one atomic model step
                a = s.add_message(sid, seg, "assistant", f"s{i}", tool_calls=[{"name": "ls"}])
                n = 1 + i % 5
                routes = np.full((n, 2, 2), 300 if i % 2 else 7)
                s.add_sample(sid, seg, a, list(range(50)), list(range(n)), [-0.5] * n, routes, 0)
                tc = s.add_tool_call(sid, a, f"c{i}", "ls", {"path": "."})
            s.finish_tool_call(tc, "out", True, 0.01)
            s.add_message(sid, seg, "tool", "out", tool_call_id=f"c{i}")
            if i % 4 == 3:
                seg += 1
                s.add_segment(sid, seg, f"summary {i}")
            i += 1

    root, trials = sys.argv[1], int(sys.argv[2])
    rng = random.Random(int(sys.argv[3]))
    for t in range(trials):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                child(os.path.join(root, str(t)), w)
            finally:
                os._exit(1)
        if t % 3 == 0:
            time.sleep(rng.uniform(0, 0.03))              # while opening / migrating
        else:
            os.read(r, 1)
            time.sleep(rng.uniform(0, 0.05))              # while writing steps
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r), os.close(w)
"""


def check_consistent(home: Path) -> int:
    """Assert the database at `home` is consistent and resumable; return its message count."""
    with SessionStore(home) as s:                         # opens (and finishes migrating)
        assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert s.db.execute("PRAGMA foreign_key_check").fetchall() == []
        for sess in s.list_sessions():
            sid = sess["id"]
            msgs, calls, samples = s.messages(sid), s.tool_calls(sid), s.samples(sid)
            assert [m["idx"] for m in msgs] == list(range(len(msgs)))
            assistant = [m["id"] for m in msgs if m["role"] == "assistant"]
            assert [c["message_id"] for c in calls] == assistant       # whole steps only
            assert [x["message_id"] for x in samples] == assistant
            for x in samples:
                n = len(x["completion_ids"])
                assert len(x["logprobs"]) == n and x["routes"].shape == (n, 2, 2)
                assert x["prompt_ids"] == list(range(50))
            unfinished = [c for c in calls if c["result"] is None]
            assert unfinished in ([], calls[-1:])
            tool_msgs = [m for m in msgs if m["role"] == "tool"]
            assert len(tool_msgs) in (len(calls), len(calls) - 1)
            s.add_message(sid, s.segments(sid)[-1]["idx"], "user", "resumed")  # resumable
            assert s.messages(sid)[-1]["idx"] == len(msgs)
        return s.db["messages"].count


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_at_random_points_leaves_a_consistent_db(tmp_path):
    trials = 30
    finish(run_python(KILLER, str(tmp_path), str(trials), str(time.time_ns())))
    written = [check_consistent(tmp_path / str(t)) for t in range(trials)]
    assert sum(n > 1 for n in written) >= trials // 2     # most kills hit the write loop


def test_the_schema_checks_agree_with_the_constants_the_code_uses(tmp_path):
    """Migrations are literal SQL; when a constant changes, this says a migration is due."""
    import re

    from agent_runtime.names import CYCLE_STATUSES, ORIGINS, STATUSES
    from agent_runtime.store import FEEDBACK_REASONS
    from agent_runtime.store.blobs import ROUTES_DTYPES
    store = SessionStore(tmp_path)
    schema = " ".join(r[0] for r in store.db.execute(
        "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall())
    store.close()

    def listed(column: str) -> list[set[str]]:
        return [set(re.findall(r"'([^']*)'", values))
                for values in re.findall(rf"\b{column} IN\s*\(([^)]*)\)", schema)]

    assert listed("reason") == [set(FEEDBACK_REASONS)]
    assert listed("routes_dtype") == [set(ROUTES_DTYPES)]
    assert listed("origin") == [set(ORIGINS)]
    assert sorted(map(sorted, listed("status"))) == sorted([sorted(STATUSES),
                                                            sorted(CYCLE_STATUSES)])


def test_names_imports_nothing_of_the_project():
    import ast

    import agent_runtime.names as names
    tree = ast.parse(Path(names.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert all(m == "__future__" for m in imported), imported


def test_rewards_are_written_and_read_through_the_store(tmp_path):
    store = SessionStore(tmp_path)
    sid = store.create_session("t", str(tmp_path), "m", 0, origin="rollout")
    rid = store.add_reward(sid[:8], "fix_bug/train/1", 1.0, True, family="fix_bug",
                           split="train", detail="3 passed", meta={"exit_code": 0})
    (row,) = store.rewards(sid)
    assert row["id"] == rid and row["passed"] is True and row["cheated"] is False
    assert row["meta"] == {"exit_code": 0} and row["family"] == "fix_bug"
    with pytest.raises(KeyError):
        store.add_reward("no-such-session", "x", 0.0, False)
    assert len(store.rewards()) == 1
    store.close()
