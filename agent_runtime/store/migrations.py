"""Numbered schema migrations for `apprentice.db` (the simonw/llm pattern).

Each migration is a function `mNNN_name(db)` registered with `@migration`, applied once, in
order, and recorded in the `_migrations` table. `migrate()` runs every missing migration in a
single `BEGIN IMMEDIATE` transaction, so two processes opening a fresh database at the same time
serialize on SQLite's write lock: the first applies the migrations, the second finds them
recorded and does nothing. Never edit a released migration; add a new one. Migrations are
literal SQL: a CHECK lists its values as written when it was released, not a constant that
may change later (`tests/agent_runtime/test_store.py` checks the schema still agrees with
the constants, so a changed constant asks for a new migration).

This module owns the schema only; reading and writing rows is `store.py`'s job.
"""

from __future__ import annotations

import datetime as _dt
from typing import Callable

import sqlite_utils


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = []

FEEDBACK_REASONS = ("misunderstood", "wrong_change", "unnecessary_change", "should_ask",
                    "incomplete", "other")


def migration(fn: Callable[[sqlite_utils.Database], None]):
    """Register `fn` as the next migration; its name (`mNNN_...`) is its identity."""
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    for sql in [
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY,                 -- uuid4 hex
            task TEXT NOT NULL,
            workspace TEXT NOT NULL,
            model TEXT NOT NULL,
            policy_version INTEGER NOT NULL DEFAULT 0,
            status TEXT NOT NULL DEFAULT 'running' CHECK (status IN
                ('running', 'finished', 'failed', 'cancelled', 'budget_exhausted')),
            summary TEXT,
            meta TEXT,                           -- JSON object or NULL
            pid INTEGER,                         -- process that created the session
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
        "CREATE INDEX sessions_created_at ON sessions (created_at)",
        """CREATE TABLE segments (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,                -- 0, 1, ... within the session
            summary TEXT,                        -- what the previous segments were about
            created_at TEXT NOT NULL,
            UNIQUE (session_id, idx)
        )""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,                -- per-session sequence 0, 1, 2, ...
            segment INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT,
            tool_calls TEXT,                     -- JSON list or NULL
            tool_call_id TEXT,
            name TEXT,
            meta TEXT,
            created_at TEXT NOT NULL,
            UNIQUE (session_id, idx),
            FOREIGN KEY (session_id, segment) REFERENCES segments (session_id, idx)
        )""",
        """CREATE TABLE tool_calls (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            message_id INTEGER NOT NULL REFERENCES messages (id) ON DELETE CASCADE,
            call_id TEXT NOT NULL,               -- the id the model/loop gave the call
            name TEXT NOT NULL,
            arguments TEXT NOT NULL,             -- JSON: an object, or a string as emitted
            result TEXT,                         -- NULL until finished
            ok INTEGER,
            duration_s REAL,
            data TEXT,
            created_at TEXT NOT NULL,
            finished_at TEXT
        )""",
        "CREATE INDEX tool_calls_session ON tool_calls (session_id)",
        "CREATE INDEX tool_calls_message ON tool_calls (message_id)",
        """CREATE TABLE samples (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            segment INTEGER NOT NULL,
            message_id INTEGER REFERENCES messages (id) ON DELETE SET NULL,
            prompt_ids BLOB NOT NULL,            -- uint32 little-endian
            completion_ids BLOB NOT NULL,        -- uint32 little-endian
            logprobs BLOB NOT NULL,              -- float32 little-endian, one per completion id
            n_prompt INTEGER NOT NULL,
            n_completion INTEGER NOT NULL,
            routes BLOB,                         -- [T, L, k] in routes_dtype, or NULL
            routes_dtype TEXT CHECK (routes_dtype IN ('uint8', 'int16')),
            routes_tokens INTEGER,
            routes_layers INTEGER,
            routes_k INTEGER,
            policy_version INTEGER NOT NULL,
            finish_reason TEXT NOT NULL,
            created_at TEXT NOT NULL,
            FOREIGN KEY (session_id, segment) REFERENCES segments (session_id, idx),
            CHECK (length(prompt_ids) = 4 * n_prompt),
            CHECK (length(completion_ids) = 4 * n_completion),
            CHECK (length(logprobs) = 4 * n_completion),
            CHECK (routes IS NULL OR length(routes) = routes_tokens * routes_layers * routes_k
                   * CASE routes_dtype WHEN 'uint8' THEN 1 ELSE 2 END)
        )""",
        "CREATE INDEX samples_session ON samples (session_id)",
        """CREATE TABLE feedback (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            message_id INTEGER REFERENCES messages (id) ON DELETE CASCADE,
            rating INTEGER NOT NULL CHECK (rating IN (-1, 1)),
            reason TEXT CHECK (reason IS NULL OR reason IN ('misunderstood', 'wrong_change', 
                'unnecessary_change', 'should_ask', 'incomplete', 'other')),
            source TEXT NOT NULL DEFAULT 'explicit',   -- explicit | edit_kept | edit_reverted | ...
            comment TEXT,
            created_at TEXT NOT NULL
        )""",
        "CREATE INDEX feedback_session ON feedback (session_id)",
        """CREATE TABLE policy_versions (
            version INTEGER PRIMARY KEY,
            sha256 TEXT NOT NULL,                -- of the canonical bf16 tensor bytes
            source TEXT,
            meta TEXT,
            created_at TEXT NOT NULL
        )""",
    ]:
        db.execute(sql)


@migration
def m002_rewards(db: sqlite_utils.Database) -> None:
    """Rewards of graded sessions (simulated tasks, task folders); written by the learner."""
    db.execute("""CREATE TABLE rewards (
        id INTEGER PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        task_id TEXT NOT NULL,                   -- e.g. fix_bug/train/123, or a folder's name
        family TEXT,
        split TEXT,
        reward REAL NOT NULL,
        passed INTEGER NOT NULL,                 -- the hidden tests passed
        cheated INTEGER NOT NULL DEFAULT 0,      -- tampering or peeking: reward forced to 0
        detail TEXT,                             -- one line: why
        meta TEXT,                               -- JSON object or NULL (violations, timings)
        created_at TEXT NOT NULL
    )""")
    db.execute("CREATE INDEX rewards_session ON rewards (session_id)")
    db.execute("CREATE INDEX rewards_task ON rewards (task_id)")


@migration
def m003_learning_from_use(db: sqlite_utils.Database) -> None:
    """Learning from use: who made a session (`origin`: user, eval, rollout) and whether it
    may be learned from (`learn`), the online learner's cycles, and which samples a finished
    cycle consumed (each sample at most once)."""
    for sql in [
        """ALTER TABLE sessions ADD COLUMN origin TEXT NOT NULL DEFAULT 'user'
            CHECK (origin IN ('user', 'eval', 'rollout'))""",
        "ALTER TABLE sessions ADD COLUMN learn INTEGER NOT NULL DEFAULT 1",  # 0: never trained on
        # graded sessions are never a person's: rollouts and evaluations made before this
        "UPDATE sessions SET origin = 'rollout' WHERE id IN (SELECT session_id FROM rewards)",
        """CREATE TABLE learner_cycles (
            id INTEGER PRIMARY KEY,
            status TEXT NOT NULL CHECK (status IN ('running', 'publishing', 'published',
                'rejected', 'empty', 'interrupted', 'failed')),
            pid INTEGER,                         -- the learner process running it
            base_version INTEGER,                -- the serving version it trained from
            version INTEGER,                     -- the version it published, or NULL
            candidate_sha256 TEXT,               -- state hash of the candidate (publishing)
            sample_ids TEXT,                     -- JSON list of the samples it trains on
            samples INTEGER NOT NULL DEFAULT 0,
            liked INTEGER NOT NULL DEFAULT 0,
            disliked INTEGER NOT NULL DEFAULT 0,
            gate TEXT,                           -- JSON: passed, reason, metrics
            logprob_shift TEXT,                  -- JSON: liked and disliked mean shifts
            reason TEXT,                         -- one line: why it ended as it did
            started_at TEXT NOT NULL,
            finished_at TEXT
        )""",
        """CREATE TABLE trained_samples (
            sample_id INTEGER PRIMARY KEY REFERENCES samples (id) ON DELETE CASCADE,
            cycle_id INTEGER NOT NULL REFERENCES learner_cycles (id),
            reward REAL NOT NULL
        )""",
        """CREATE TABLE signal_scans (           -- implicit signals derived for a session
            session_id TEXT PRIMARY KEY REFERENCES sessions (id) ON DELETE CASCADE,
            edits_done INTEGER NOT NULL DEFAULT 0, -- edits kept/reverted judged (or none)
            scanned_at TEXT NOT NULL
        )""",
        "CREATE INDEX feedback_source ON feedback (source)",
        "CREATE INDEX samples_message ON samples (message_id)",
        # what each rating covers: a session rating (target NULL) every sample of the
        # session; a message rating the sample of that message, or for a tool result or a
        # user message, of the assistant message before it (-1: none, covers nothing)
        """CREATE VIEW feedback_targets AS
            SELECT f.id AS feedback_id, f.session_id, f.rating, f.reason, f.source,
                   f.created_at, f.message_id,
                   CASE WHEN f.message_id IS NULL THEN NULL ELSE COALESCE(
                       (SELECT a.id FROM messages a JOIN messages m ON m.id = f.message_id
                        WHERE a.session_id = m.session_id AND a.role = 'assistant'
                          AND a.idx <= m.idx ORDER BY a.idx DESC LIMIT 1), -1)
                   END AS target_message_id
            FROM feedback f""",
    ]:
        db.execute(sql)


@migration
def m004_sample_temperature(db: sqlite_utils.Database) -> None:
    """The temperature a sample's logprobs were recorded at: > 0 sampled from logits / T;
    0 greedy (logprobs of the unscaled distribution); NULL not recorded (older rows, scripted
    policies), read as the unscaled distribution."""
    db.execute("ALTER TABLE samples ADD COLUMN temperature REAL CHECK (temperature >= 0)")


@migration
def m005_rating_replaces(db: sqlite_utils.Database) -> None:
    """A user's new rating of the same session or message replaces the earlier one (a thumbs
    toggle): the earlier row stays, as history, with `replaced_by` set, and no longer covers
    anything. Implicit signals are never replaced."""
    for sql in [
        "ALTER TABLE feedback ADD COLUMN replaced_by INTEGER REFERENCES feedback (id)",
        "DROP VIEW feedback_targets",
        """CREATE VIEW feedback_targets AS
            SELECT f.id AS feedback_id, f.session_id, f.rating, f.reason, f.source,
                   f.created_at, f.message_id,
                   CASE WHEN f.message_id IS NULL THEN NULL ELSE COALESCE(
                       (SELECT a.id FROM messages a JOIN messages m ON m.id = f.message_id
                        WHERE a.session_id = m.session_id AND a.role = 'assistant'
                          AND a.idx <= m.idx ORDER BY a.idx DESC LIMIT 1), -1)
                   END AS target_message_id
            FROM feedback f WHERE f.replaced_by IS NULL""",
    ]:
        db.execute(sql)


@migration
def m006_sample_forced(db: sqlite_utils.Database) -> None:
    """The completion positions whose token the call grammar chose: the model's own draw
    could not run, and the token was drawn again from what could (`Generation.forced`;
    uint32 as `completion_ids`). NULL: none, or not recorded (older rows)."""
    db.execute("ALTER TABLE samples ADD COLUMN forced BLOB")


def _applied(db: sqlite_utils.Database) -> set[str]:
    if not db["_migrations"].exists():
        return set()
    return {row["name"] for row in db.query("SELECT name FROM _migrations")}


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the missing migrations in one transaction; return the names applied now."""
    wanted = [fn.__name__ for fn in MIGRATIONS]
    if set(wanted) <= _applied(db):                   # fast path: no write lock needed
        return []
    db.conn.execute("BEGIN IMMEDIATE")                 # waits (busy_timeout) for other writers
    try:
        db.execute("CREATE TABLE IF NOT EXISTS _migrations "
                   "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
        done = _applied(db)
        applied = []
        for fn in MIGRATIONS:
            if fn.__name__ in done:
                continue
            fn(db)
            now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
            db.execute("INSERT INTO _migrations (name, applied_at) VALUES (?, ?)",
                       [fn.__name__, now])
            applied.append(fn.__name__)
        db.conn.execute("COMMIT")
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
    return applied
