"""The session store: every session, message, tool call, model sample and rating, in SQLite
(and the learner's record of its cycles).

State lives under `$APPRENTICE_HOME` (default `~/.apprentice`): `apprentice.db` and one folder
per session (`sessions/<id>/`). The database runs in WAL mode with a 30 s busy timeout and
foreign keys on, so several runtimes (an agent, the TUI, the learner, `apprentice feedback`)
can share it.

Every write method is its own `BEGIN IMMEDIATE ... COMMIT` transaction and has committed when
it returns: killing the process at any moment leaves a consistent database, and a session can
be resumed from what is there. `transaction()` groups several writes into one atomic step.
`synchronous=NORMAL` keeps commits cheap; in WAL mode that is crash-safe for the process, and
after a power cut loses at most the last few commits, never consistency.

This module does not render prompts, decide what a step is, or compute rewards; it only
records and returns what the runtime hands it (token ids exactly as generated).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import sqlite_utils

from agent_runtime import names

from agent_runtime.names import EXPLICIT, ORIGIN_USER, ORIGINS
from agent_runtime.store import blobs
from agent_runtime.store.migrations import FEEDBACK_REASONS, migrate

STATUSES = names.STATUSES
BUSY_TIMEOUT_S = 30.0


def default_home() -> Path:
    """`$APPRENTICE_HOME`, else `~/.apprentice`."""
    return Path(os.environ.get("APPRENTICE_HOME") or "~/.apprentice").expanduser()


def _pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists on this machine (unknown pid: assume alive)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


class SessionStore:
    """The SQLite store of one `$APPRENTICE_HOME`. Safe to share between threads."""

    def __init__(self, home: str | Path | None = None):
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.home.mkdir(parents=True, exist_ok=True)
        self.db_path = self.home / "apprentice.db"
        conn = sqlite3.connect(str(self.db_path), timeout=BUSY_TIMEOUT_S,
                               isolation_level=None, check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        self._lock = threading.RLock()
        self._depth = 0                                # transaction() nesting
        self._set_pragmas()
        migrate(self.db)

    def _set_pragmas(self) -> None:
        conn = self.db.conn
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:                                    # switching to WAL needs a brief lock
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        if mode.lower() != "wal":
            raise RuntimeError(f"could not enable WAL mode on {self.db_path} (got {mode!r})")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self.db.close()

    def __enter__(self) -> "SessionStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def session_dir(self, session_id: str) -> Path:
        """`home/sessions/<id>`, created on demand (accepts a unique prefix)."""
        path = self.home / "sessions" / self._resolve(session_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def transaction(self) -> Iterator["SessionStore"]:
        """One atomic step: writes inside commit together, or not at all.

        The outermost block holds SQLite's write lock (`BEGIN IMMEDIATE`) until it ends, so
        keep model calls outside it. Nested blocks are savepoints.
        """
        with self._lock:
            conn, level = self.db.conn, self._depth
            name = f"sp{level}"
            conn.execute("BEGIN IMMEDIATE" if level == 0 else f"SAVEPOINT {name}")
            self._depth = level + 1
            try:
                yield self
                conn.execute("COMMIT" if level == 0 else f"RELEASE {name}")
            except BaseException:
                if conn.in_transaction:
                    if level == 0:
                        conn.execute("ROLLBACK")
                    else:
                        conn.execute(f"ROLLBACK TO {name}")
                        conn.execute(f"RELEASE {name}")
                raise
            finally:
                self._depth = level

    def _insert(self, sql: str, params: list) -> int:
        return self.db.execute(sql, params).lastrowid

    def _require_session(self, session_id: str) -> None:
        if not self.db.execute("SELECT 1 FROM sessions WHERE id = ?", [session_id]).fetchone():
            raise KeyError(f"no session with id {session_id!r}")

    def _ensure_segment(self, session_id: str, index: int) -> None:
        self.db.execute("INSERT OR IGNORE INTO segments (session_id, idx, summary, created_at) "
                        "VALUES (?, ?, NULL, ?)", [session_id, index, _now()])

    def _require_message(self, session_id: str, message_id: int) -> None:
        row = self.db.execute("SELECT session_id FROM messages WHERE id = ?",
                              [message_id]).fetchone()
        if row is None:
            raise ValueError(f"no message with id {message_id}")
        if row[0] != session_id:
            raise ValueError(f"message {message_id} belongs to session {row[0]}, "
                             f"not {session_id}")

    def _require_rateable(self, message_id: int) -> None:
        """A user rates what the model wrote: an assistant message, not a tool result or their
        own message (the error names the assistant message before it, when there is one)."""
        role, idx, session_id = self.db.execute(
            "SELECT role, idx, session_id FROM messages WHERE id = ?", [message_id]).fetchone()
        if role == "assistant":
            return
        before = self.db.execute(
            "SELECT id FROM messages WHERE session_id = ? AND role = 'assistant' AND idx < ? "
            "ORDER BY idx DESC LIMIT 1", [session_id, idx]).fetchone()
        instead = (f"rate the assistant message #{before[0]} before it" if before else
                   "no assistant message comes before it: rate the session")
        raise ValueError(f"message #{message_id} is a {role} message, not what the model "
                         f"wrote; {instead}")

    def _touch(self, session_id: str) -> None:
        self.db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [_now(), session_id])

    # -- writes (each commits before returning) ----------------------------------------------

    def create_session(self, task: str, workspace: str, model: str, policy_version: int = 0,
                       meta: dict | None = None, session_id: str | None = None, *,
                       origin: str = ORIGIN_USER, learn: bool = True) -> str:
        """A new "running" session with segment 0; returns its id (`session_id`, or a new
        uuid4 hex).

        `origin` says who made it (`names.ORIGINS`: only "user" sessions are learned from);
        `learn=False` excludes it from learning for good."""
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {', '.join(ORIGINS)}, got {origin!r}")
        session_id = session_id or uuid.uuid4().hex
        now = _now()
        with self.transaction():
            self.db.execute(
                "INSERT INTO sessions (id, task, workspace, model, policy_version, status, "
                "meta, pid, created_at, updated_at, origin, learn) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [session_id, task, str(workspace), model, int(policy_version), names.RUNNING,
                 _dumps(meta),
                 os.getpid(), now, now, origin, int(bool(learn))])
            self._ensure_segment(session_id, 0)
        return session_id

    def add_segment(self, session_id: str, index: int, summary: str | None = None) -> int:
        """Start (or re-summarize) segment `index`; returns the segment's row id."""
        with self.transaction():
            self._require_session(session_id)
            self._ensure_segment(session_id, index)
            if summary is not None:
                self.db.execute("UPDATE segments SET summary = ? WHERE session_id = ? AND idx = ?",
                                [summary, session_id, index])
            self._touch(session_id)
            return self.db.execute("SELECT id FROM segments WHERE session_id = ? AND idx = ?",
                                   [session_id, index]).fetchone()[0]

    def add_message(self, session_id: str, segment: int, role: str, content: str, *,
                    tool_calls: list[dict] | None = None, tool_call_id: str | None = None,
                    name: str | None = None, meta: dict | None = None) -> int:
        """Append a message (next per-session idx); returns its row id."""
        with self.transaction():
            self._require_session(session_id)
            self._ensure_segment(session_id, segment)
            idx = self.db.execute("SELECT COALESCE(MAX(idx) + 1, 0) FROM messages "
                                  "WHERE session_id = ?", [session_id]).fetchone()[0]
            message_id = self._insert(
                "INSERT INTO messages (session_id, idx, segment, role, content, tool_calls, "
                "tool_call_id, name, meta, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [session_id, idx, segment, role, content, _dumps(tool_calls), tool_call_id,
                 name, _dumps(meta), _now()])
            self._touch(session_id)
        return message_id

    def add_tool_call(self, session_id: str, message_id: int, call_id: str, name: str,
                      arguments: dict | str, *, result: str | None = None,
                      ok: bool | None = None, duration_s: float | None = None,
                      data: dict | None = None) -> int:
        """Record a tool call of assistant message `message_id`; returns its row id."""
        with self.transaction():
            self._require_message(session_id, message_id)
            return self._insert(
                "INSERT INTO tool_calls (session_id, message_id, call_id, name, arguments, "
                "result, ok, duration_s, data, created_at, finished_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [session_id, message_id, call_id, name, json.dumps(arguments), result,
                 None if ok is None else int(ok), duration_s, _dumps(data), _now(),
                 None if result is None else _now()])

    def finish_tool_call(self, tool_call_id: int, result: str, ok: bool, duration_s: float,
                         data: dict | None = None) -> None:
        """Fill in the outcome of a tool call (row id from `add_tool_call`)."""
        with self.transaction():
            cur = self.db.execute(
                "UPDATE tool_calls SET result = ?, ok = ?, duration_s = ?, "
                "data = COALESCE(?, data), finished_at = ? WHERE id = ?",
                [result, int(ok), duration_s, _dumps(data), _now(), tool_call_id])
            if cur.rowcount == 0:
                raise KeyError(f"no tool call with id {tool_call_id}")

    def add_sample(self, session_id: str, segment: int, message_id: int | None, prompt_ids,
                   completion_ids, logprobs, routes, policy_version: int,
                   finish_reason: str = names.FINISH_STOP, temperature: float | None = None,
                   forced: Sequence[int] | None = None) -> int:
        """Record one model call as compact blobs (see `blobs`); returns its row id.
        `temperature`: what the logprobs were recorded at (0 greedy, None unknown);
        `forced`: the completion positions whose token the call grammar chose."""
        prompt = blobs.encode_ids(prompt_ids)
        completion = blobs.encode_ids(completion_ids)
        lps = blobs.encode_logprobs(logprobs)
        if len(lps) != len(completion):
            raise ValueError(f"{len(lps) // 4} logprobs for {len(completion) // 4} "
                             "completion tokens; need one per token")
        n_completion = len(completion) // 4
        if forced and not all(0 <= int(i) < n_completion for i in forced):
            raise ValueError(f"forced positions {list(forced)[:8]} outside the "
                             f"{n_completion} completion tokens")
        encoded = blobs.encode_routes(routes)
        r_blob, r_dtype, (r_t, r_l, r_k) = encoded or (None, None, (None, None, None))
        with self.transaction():
            self._require_session(session_id)
            if message_id is not None:
                self._require_message(session_id, message_id)
            self._ensure_segment(session_id, segment)
            return self._insert(
                "INSERT INTO samples (session_id, segment, message_id, prompt_ids, "
                "completion_ids, logprobs, n_prompt, n_completion, routes, routes_dtype, "
                "routes_tokens, routes_layers, routes_k, policy_version, finish_reason, "
                "temperature, forced, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "?, ?, ?, ?, ?, ?)",
                [session_id, segment, message_id, prompt, completion, lps, len(prompt) // 4,
                 n_completion, r_blob, r_dtype, r_t, r_l, r_k, int(policy_version),
                 finish_reason, None if temperature is None else float(temperature),
                 blobs.encode_ids(forced) if forced else None, _now()])

    def link_sample(self, sample_id: int, message_id: int) -> None:
        """Attach a sample recorded before its message existed to that message."""
        with self.transaction():
            row = self.db.execute("SELECT session_id FROM samples WHERE id = ?",
                                  [sample_id]).fetchone()
            if row is None:
                raise KeyError(f"no sample with id {sample_id}")
            self._require_message(row[0], message_id)
            self.db.execute("UPDATE samples SET message_id = ? WHERE id = ?",
                            [message_id, sample_id])

    def add_feedback(self, rating: int, *, session_id: str, message_id: int | None = None,
                     reason: str | None = None, source: str = EXPLICIT,
                     comment: str | None = None) -> int:
        """Rate a session or one of its messages (+1/-1); returns the feedback row id. A
        user's (`EXPLICIT`) rating is of the session or of an assistant message (ValueError
        for a tool result or a user message), and replaces their earlier one of the same
        session or message: the earlier row is kept with `replaced_by` set and no longer
        counts. Implicit sources may rate any message of the session."""
        if isinstance(rating, bool) or rating not in (1, -1):
            raise ValueError(f"rating must be +1 or -1, got {rating!r}")
        if reason is not None and reason not in FEEDBACK_REASONS:
            raise ValueError(f"reason must be one of {', '.join(FEEDBACK_REASONS)} "
                             f"(or None), got {reason!r}")
        if not isinstance(source, str) or not source:    # a names.FEEDBACK_SOURCES entry,
            raise ValueError(                            # or one a plugin declares
                f"source must be a non-empty string, got {source!r}")
        with self.transaction():
            session_id = self._resolve(session_id)
            if message_id is not None:
                self._require_message(session_id, message_id)
                if source == EXPLICIT:
                    self._require_rateable(message_id)
            row = self._insert(
                "INSERT INTO feedback (session_id, message_id, rating, reason, source, comment, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [session_id, message_id, int(rating), reason, source, comment, _now()])
            if source == EXPLICIT:
                self.db.execute(
                    "UPDATE feedback SET replaced_by = ? WHERE session_id = ? AND message_id IS ? "
                    "AND source = ? AND id != ? AND replaced_by IS NULL",
                    [row, session_id, message_id, EXPLICIT, row])
            return row

    def set_status(self, session_id: str, status: str, summary: str | None = None) -> None:
        """Set a session's status (and summary, when given)."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        with self.transaction():
            cur = self.db.execute(      # "running" again (a resume): this process owns it now
                "UPDATE sessions SET status = ?, summary = COALESCE(?, summary), updated_at = ?, "
                "pid = CASE WHEN ? = ? THEN ? ELSE pid END WHERE id = ?",
                [status, summary, _now(), status, names.RUNNING, os.getpid(), session_id])
            if cur.rowcount == 0:
                raise KeyError(f"no session with id {session_id!r}")

    def record_policy_version(self, version: int, sha256: str, source: str | None = None,
                              meta: dict | None = None) -> None:
        """Register a policy version; re-recording the same hash is a no-op, a different
        hash for a known version is a ValueError."""
        with self.transaction():
            row = self.db.execute("SELECT sha256 FROM policy_versions WHERE version = ?",
                                  [int(version)]).fetchone()
            if row is not None:
                if row[0] != sha256:
                    raise ValueError(f"policy version {version} is already recorded with "
                                     f"sha256 {row[0]}, not {sha256}")
                return
            self.db.execute("INSERT INTO policy_versions (version, sha256, source, meta, "
                            "created_at) VALUES (?, ?, ?, ?, ?)",
                            [int(version), sha256, source, _dumps(meta), _now()])

    # the learner's records: its cycles, the samples they consumed, the sessions it scanned

    def add_cycle(self, sample_ids: list[int], base_version: int | None) -> int:
        """Start a learning cycle ("running", this process) over these samples; returns its id."""
        with self.transaction():
            return self._insert(
                "INSERT INTO learner_cycles (status, pid, base_version, sample_ids, started_at) "
                "VALUES (?, ?, ?, ?, ?)", [names.CYCLE_RUNNING, os.getpid(), base_version,
                                           json.dumps(sample_ids), _now()])

    def set_cycle_publishing(self, cycle_id: int, candidate_sha256: str) -> None:
        """Mark a cycle "publishing" its candidate (state hash), before the version store does."""
        with self.transaction():
            self.db.execute("UPDATE learner_cycles SET status = ?, candidate_sha256 = ? "
                            "WHERE id = ?", [names.CYCLE_PUBLISHING, candidate_sha256, cycle_id])

    def finish_cycle(self, cycle_id: int, status: str, consumed: list[tuple[int, float]], *,
                     gate: dict, samples: int = 0, liked: int = 0, disliked: int = 0,
                     logprob_shift: dict | None = None, version: int | None = None,
                     reason: str | None = None) -> None:
        """End a cycle and mark its `(sample_id, reward)` pairs consumed, in one transaction."""
        with self.transaction():
            self.db.conn.executemany(
                "INSERT OR IGNORE INTO trained_samples (sample_id, cycle_id, reward) "
                "VALUES (?, ?, ?)", [(i, cycle_id, r) for i, r in consumed])
            self.db.execute(
                "UPDATE learner_cycles SET status = ?, version = ?, samples = ?, liked = ?, "
                "disliked = ?, gate = ?, logprob_shift = ?, reason = ?, finished_at = ? "
                "WHERE id = ?", [status, version, samples, liked, disliked, _dumps(gate),
                                 _dumps(logprob_shift), reason, _now(), cycle_id])

    def interrupt_cycle(self, cycle_id: int, reason: str) -> None:
        """End a cycle a killed learner left "interrupted", consuming none of its samples."""
        with self.transaction():
            self.db.execute("UPDATE learner_cycles SET status = ?, reason = ?, finished_at = ? "
                            "WHERE id = ?", [names.CYCLE_INTERRUPTED, reason, _now(), cycle_id])

    def record_scan(self, session_id: str, edits_done: bool) -> None:
        """Note that a session's implicit signals were derived (its edits too: `edits_done`)."""
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO signal_scans (session_id, edits_done, "
                            "scanned_at) VALUES (?, ?, ?)", [session_id, int(edits_done), _now()])

    def delete_session(self, session_id: str) -> None:
        """Delete a session, everything recorded for it, and its folder."""
        with self.transaction():
            session_id = self._resolve(session_id)
            self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        shutil.rmtree(self.home / "sessions" / session_id, ignore_errors=True)

    # -- reads -------------------------------------------------------------------------------

    def _resolve(self, session_id_or_prefix: str) -> str:
        key = session_id_or_prefix
        with self._lock:
            if self.db.execute("SELECT 1 FROM sessions WHERE id = ?", [key]).fetchone():
                return key
            if not key:
                raise KeyError("empty session id")
            ids = [r[0] for r in self.db.execute(
                "SELECT id FROM sessions WHERE substr(id, 1, ?) = ? ORDER BY created_at DESC",
                [len(key), key]).fetchmany(6)]
        if not ids:
            raise KeyError(f"no session matching {key!r}")
        if len(ids) > 1:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            raise KeyError(f"ambiguous session prefix {key!r} matches several sessions: {shown}")
        return ids[0]

    def _rows(self, sql: str, params: list | None = None) -> list[dict]:
        with self._lock:
            return list(self.db.query(sql, params or []))

    def query(self, sql: str, params: list | None = None) -> list[dict]:
        """Rows of a read-only SQL query, as dicts (safe while other threads write)."""
        return self._rows(sql, params)

    _SESSION_SQL = ("SELECT s.*, (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) "
                    "AS message_count FROM sessions s")

    @staticmethod
    def _session(row: dict) -> dict:
        row["meta"] = _loads(row["meta"])
        row["learn"] = bool(row["learn"])
        # "running" in the table but its process is gone (killed, crashed): `resume` continues it
        row["interrupted"] = row["status"] == names.RUNNING and not _pid_alive(row.get("pid"))
        return row

    def get_session(self, session_id_or_prefix: str) -> dict:
        """The session with this id or unique id prefix; KeyError when missing/ambiguous."""
        session_id = self._resolve(session_id_or_prefix)
        return self._session(self._rows(self._SESSION_SQL + " WHERE s.id = ?", [session_id])[0])

    def set_learn(self, session_id: str, learn: bool) -> None:
        """Include a session in learning, or exclude it (its samples are never trained on)."""
        with self.transaction():
            session_id = self._resolve(session_id)
            self.db.execute("UPDATE sessions SET learn = ? WHERE id = ?",
                            [int(bool(learn)), session_id])

    def list_sessions(self, limit: int = 50, include_all: bool = False) -> list[dict]:
        """Newest first, each with `message_count`; only the user's own sessions unless
        `include_all` (then also those `eval` and the learner's rollouts made)."""
        where = "" if include_all else f" WHERE s.origin = '{ORIGIN_USER}'"
        rows = self._rows(self._SESSION_SQL + where + " ORDER BY s.created_at DESC, "
                          "s.rowid DESC LIMIT ?", [int(limit)])
        return [self._session(r) for r in rows]

    def sessions_in(self, workspace: str | Path) -> list[dict]:
        """Every session (any origin) that ran in `workspace`, newest first."""
        rows = self._rows(self._SESSION_SQL + " WHERE s.workspace = ? ORDER BY s.created_at DESC",
                          [str(workspace)])
        return [self._session(r) for r in rows]

    def messages(self, session_id: str, segment: int | None = None) -> list[dict]:
        """Messages ordered by idx (optionally one segment's), JSON fields decoded."""
        session_id = self._resolve(session_id)
        sql = ("SELECT id, session_id, idx, segment, role, content, tool_calls, tool_call_id, "
               "name, meta, created_at FROM messages WHERE session_id = ?")
        params: list = [session_id]
        if segment is not None:
            sql += " AND segment = ?"
            params.append(segment)
        rows = self._rows(sql + " ORDER BY idx", params)
        for r in rows:
            r["tool_calls"] = _loads(r["tool_calls"])
            r["meta"] = _loads(r["meta"])
        return rows

    def tool_calls(self, session_id: str) -> list[dict]:
        """Tool calls in the order they were recorded; `ok` is a bool (None if unfinished)."""
        rows = self._rows("SELECT * FROM tool_calls WHERE session_id = ? ORDER BY id",
                          [self._resolve(session_id)])
        for r in rows:
            r["arguments"] = json.loads(r["arguments"])
            r["ok"] = None if r["ok"] is None else bool(r["ok"])
            r["data"] = _loads(r["data"])
        return rows

    def segments(self, session_id: str) -> list[dict]:
        """Segments ordered by index (`idx`)."""
        return self._rows("SELECT * FROM segments WHERE session_id = ? ORDER BY idx",
                          [self._resolve(session_id)])

    def samples(self, session_id: str) -> list[dict]:
        """Samples in order, blobs decoded (ids/logprobs as lists, routes as ndarray)."""
        rows = self._rows("SELECT * FROM samples WHERE session_id = ? ORDER BY id",
                          [self._resolve(session_id)])
        return [self._decode_sample(r) for r in rows]

    def samples_by_id(self, ids: list[int]) -> list[dict]:
        """The samples with these row ids, in id order, decoded as `samples` decodes them."""
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        rows = self._rows(f"SELECT * FROM samples WHERE id IN ({marks}) ORDER BY id",
                          [int(i) for i in ids])
        return [self._decode_sample(r) for r in rows]

    @staticmethod
    def _decode_sample(r: dict) -> dict:
        shape = None if r["routes_dtype"] is None else (
            r["routes_tokens"], r["routes_layers"], r["routes_k"])
        return {
            "id": r["id"], "session_id": r["session_id"], "segment": r["segment"],
            "message_id": r["message_id"],
            "prompt_ids": blobs.decode_ids(r["prompt_ids"]),
            "completion_ids": blobs.decode_ids(r["completion_ids"]),
            "logprobs": blobs.decode_logprobs(r["logprobs"]),
            "routes": blobs.decode_routes(r["routes"], r["routes_dtype"], shape),
            "policy_version": r["policy_version"], "finish_reason": r["finish_reason"],
            "temperature": r["temperature"], "created_at": r["created_at"],
            "forced": blobs.decode_ids(r["forced"]),
        }

    def add_reward(self, session_id: str, task_id: str, reward: float, passed: bool, *,
                   family: str | None = None, split: str | None = None, cheated: bool = False,
                   detail: str | None = None, meta: dict | None = None) -> int:
        """Record the grade of a graded session (a simulated task, a task folder); returns the
        row id."""
        with self.transaction():
            session_id = self._resolve(session_id)
            return self._insert(
                "INSERT INTO rewards (session_id, task_id, family, split, reward, passed, "
                "cheated, detail, meta, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [session_id, task_id, family, split, float(reward), int(passed), int(cheated),
                 detail, None if meta is None else json.dumps(meta), _now()])

    def rewards(self, session_id: str | None = None) -> list[dict]:
        """Recorded grades (all, or one session's), oldest first; JSON and flags decoded."""
        sql, params = "SELECT * FROM rewards", []
        if session_id is not None:
            sql, params = sql + " WHERE session_id = ?", [self._resolve(session_id)]
        rows = self._rows(sql + " ORDER BY id", params)
        for r in rows:
            r["meta"] = _loads(r["meta"])
            r["passed"], r["cheated"] = bool(r["passed"]), bool(r["cheated"])
        return rows

    def feedback(self, session_id: str | None = None) -> list[dict]:
        """Feedback rows in the order given, for one session or all."""
        if session_id is None:
            return self._rows("SELECT * FROM feedback ORDER BY id")
        return self._rows("SELECT * FROM feedback WHERE session_id = ? ORDER BY id",
                          [self._resolve(session_id)])

    def policy_versions(self) -> list[dict]:
        """Recorded policy versions, oldest first."""
        rows = self._rows("SELECT * FROM policy_versions ORDER BY version")
        for r in rows:
            r["meta"] = _loads(r["meta"])
        return rows
