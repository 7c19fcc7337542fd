"""What the runtime knows about learning from use: the user's settings, who may be learned
from, which samples wait for the learner, and the learner's state as the user sees it.

Settings live in `$APPRENTICE_HOME/config.toml`:

    [learning]
    enabled = true                 # false: no learning cycle runs
    exclude = ["~/work/secret"]    # workspaces (and folders under them) never learned from
    min_samples = 8                # rated samples that make the daemon run a cycle
    schedule_minutes = 300         # ... or this long after the last cycle, if any wait

A workspace opts out by itself with an empty file `.apprentice-no-learn` in its root; one
session with `apprentice run --no-learn` (or the TUI's `--no-learn`).

The learner's state (`learner_status`) is read from the store's `learner_cycles` table, the
version store's `latest.json` and the daemon's lock and info files under
`$APPRENTICE_HOME/learner/`, so the TUI and `apprentice learn status` show it without
importing the learner. This module trains nothing and never imports `learner`.
"""

from __future__ import annotations

import fcntl
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agent_runtime.names import ORIGIN_USER

NO_LEARN_FILE = ".apprentice-no-learn"     # in a workspace's root: never learn from it
CONFIG_FILE = "config.toml"
LEARNER_DIR = "learner"                    # under $APPRENTICE_HOME: the learner's own state
LOCK_FILE = "daemon.lock"                  # held (flock) by the one daemon of a home
DAEMON_FILE = "daemon.json"                # the running daemon: pid, url, started
VERSIONS_DIR = "versions"                  # the version store the learner publishes to


@dataclass
class LearningConfig:
    enabled: bool = True            # False: `learn online` and the daemon run no cycle
    exclude: list[str] = field(default_factory=list)  # workspaces never learned from (and
                                    # every folder under them); ~ is expanded
    min_samples: int = 8            # rated samples waiting that make the daemon run a cycle
    schedule_minutes: float = 300.0  # the daemon also runs a cycle this long after the last
                                    # one when anything waits (0 = only on min_samples)


def load_config(home: str | Path) -> LearningConfig:
    """The `[learning]` table of `home/config.toml` (defaults when absent); a ValueError
    naming the file and the key for anything it cannot use."""
    path = Path(home) / CONFIG_FILE
    if not path.exists():
        return LearningConfig()
    try:
        data = tomllib.loads(path.read_text()).get("learning", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: [learning] must be a table, got {data!r}")
    default, kwargs = LearningConfig(), {}
    known = [f.name for f in fields(LearningConfig)]
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"{path}: unknown setting learning.{key} "
                             f"(known: {', '.join(known)})")
        want = type(getattr(default, key))
        if not _fits(value, want):
            raise ValueError(f"{path}: learning.{key} must be {_KINDS[want]}, got {value!r}")
        kwargs[key] = want(value) if want in (int, float) else value
    return LearningConfig(**kwargs)


_KINDS = {bool: "true or false", int: "an integer >= 0", float: "a number >= 0",
          list: "a list of paths"}


def _fits(value: Any, want: type) -> bool:
    if want is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if want is bool:
        return isinstance(value, bool)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and value >= 0 and (want is float or float(value).is_integer())


def workspace_excluded(workspace: str | Path, config: LearningConfig) -> bool:
    """Whether sessions in `workspace` must never be learned from."""
    ws = Path(workspace).expanduser().resolve()
    if (ws / NO_LEARN_FILE).exists():
        return True
    for entry in config.exclude:
        root = Path(entry).expanduser().resolve()
        if ws == root or root in ws.parents:
            return True
    return False


def session_learns(home: str | Path, workspace: str | Path, flag: bool = True) -> bool:
    """What a new session's `learn` column should say: the flag, the workspace's opt-out and
    the config's `exclude` list (an unreadable config excludes, to be safe)."""
    if not flag:
        return False
    try:
        return not workspace_excluded(workspace, load_config(home))
    except ValueError:
        return False


# A sample is rated when a rating covers it (the `feedback_targets` view: a session rating
# covers every sample of the session, a message rating one sample), it is the user's own,
# may be learned from, has tokens, and no finished cycle has consumed it.
RATED_SAMPLES_SQL = f"""
    SELECT sa.id FROM samples sa JOIN sessions s ON s.id = sa.session_id
    WHERE s.origin = '{ORIGIN_USER}' AND s.learn = 1 AND sa.n_completion > 0
      AND sa.id NOT IN (SELECT sample_id FROM trained_samples)
      AND EXISTS (SELECT 1 FROM feedback_targets t WHERE t.session_id = sa.session_id
                  AND (t.target_message_id IS NULL OR t.target_message_id = sa.message_id))
"""


def waiting_samples(store: Any) -> int:
    """Rated samples no cycle has consumed yet."""
    return store.query(f"SELECT COUNT(*) AS n FROM ({RATED_SAMPLES_SQL})")[0]["n"]


def learner_dir(home: str | Path) -> Path:
    return Path(home) / LEARNER_DIR


def daemon_info(home: str | Path) -> dict | None:
    """The running daemon's info file (pid, url, started), or None when no daemon holds the
    home's lock."""
    lock = learner_dir(home) / LOCK_FILE
    if not lock.exists():
        return None
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:                # the daemon holds it exclusively
            try:
                return json.loads((learner_dir(home) / DAEMON_FILE).read_text())
            except (OSError, ValueError):
                return {}
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def serving_version(home: str | Path) -> int | None:
    """The newest published version of the home's version store, if any."""
    try:
        return int(json.loads((Path(home) / VERSIONS_DIR / "latest.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def last_cycle(store: Any) -> dict | None:
    rows = store.query("SELECT * FROM learner_cycles ORDER BY id DESC LIMIT 1")
    if not rows:
        return None
    row = rows[0]
    for key in ("gate", "logprob_shift", "sample_ids"):
        row[key] = json.loads(row[key]) if row[key] else None
    return row


def learner_status(store: Any) -> dict:
    """{"on", "daemon", "enabled", "serving_version", "waiting", "last_cycle"} of the
    store's home."""
    try:
        enabled, error = load_config(store.home).enabled, None
    except ValueError as exc:
        enabled, error = False, str(exc)
    daemon = daemon_info(store.home)
    return {"on": daemon is not None, "daemon": daemon, "enabled": enabled,
            "config_error": error, "serving_version": serving_version(store.home),
            "waiting": waiting_samples(store), "last_cycle": last_cycle(store)}


def status_line(status: dict) -> str:
    """One line: `on · serving v3 · 5 waiting · last cycle published v3`; just `off` when
    there is nothing to say."""
    parts = ["on" if status["on"] else "off"]
    if not status["enabled"]:
        parts.append("disabled in config.toml")
    if status["serving_version"] is not None:
        parts.append(f"serving v{status['serving_version']}")
    if status["waiting"] or status["on"]:
        parts.append(f"{status['waiting']} waiting")
    last = status["last_cycle"]
    if last is not None:
        what = last["status"] + (f" v{last['version']}" if last["version"] else "")
        if last["status"] != "published" and last.get("reason"):
            what += f" ({last['reason']})"
        parts.append(f"last cycle {what}")
    return " · ".join(parts)
