"""Rewards from sentiment: the user's thumbs and the implicit signals of how they used a
session, turned into one reward per recorded sample.

Every signal is a row of the store's `feedback` table with its `source`
(`agent_runtime.names`), so the user sees it in `apprentice sessions show` and can override
it with an explicit rating. The reward table (rating x weight):

    source                  rating  weight  covers                   detected when
    explicit                +1/-1   1.0     session or one message   `apprentice feedback`, TUI
    edit_kept               +1      0.5     session                  every file the agent
                                                                     changed is as it left it
    edit_reverted           -1      1.0     session                  every such file is back as
                                                                     it was before the session
    followup_dissatisfied   -1      0.5     the turn before it       a later user message says
                                                                     "that's wrong", "undo"...
    run_cancelled           -1      0.25    session                  the user stopped the run
    permission_rejected     -1      0.5     the turn that asked      the user declined a call
    (a plugin's source)     +1/-1   0.5     what it rates            the plugin records it
    tests_green             +1      0.5     session                  the session's last test
                                                                     command exited 0
    ran_out                 -1      0.25    session                  the agent used its step
                                                                     budget, never finished
    repeated_call           -1      1.0     the message repeating    its tool calls and their
                                            it                       results are those of an
                                                                     earlier model call
    finished_failing        -1      1.0     the `finish` message     a check the agent ran (a
                                                                     command running code or
                                                                     tests) failed, and the same
                                                                     command never passed after
    check_fixed             +1      1.0     the edits that fixed it  a check that failed
                                            and the run that passed  before the agent's first
                                                                     edit passed after it (the
                                                                     same command, exit 0)

Edits are judged when a later session starts in the same workspace, or `edit_delay_s` after
the session ended (the files compared with `edits.json`, which the agent loop writes);
edits partly changed by the user say nothing.

What a rating covers (the store's `feedback_targets` view): a session rating covers every
sample (model call) of the session, summaries included; a rating of an assistant message
covers the sample that produced it; an implicit signal on a tool result or a user message (a
dissatisfied follow-up) covers the assistant message before it. An explicit rating of a
message is of an assistant message only: the store refuses one of a tool result or a user
message, and names the assistant message to rate instead. A sample's reward: the most
specific explicit rating covering it (a message rating over a session rating, the newest
first); without one, the sum of the implicit signals covering it (weight x rating), clipped
to [-1, 1].

A model call that produced a tool call which did not parse is never rewarded by what covers
the whole session: its reward is at most `INVALID_CALL_REWARD` (-0.5), unless the user rated
that very message. A thumbs up on a session that reached its goal despite a malformed call
rates the session's good calls, not the malformed one; and a policy cannot learn to dodge
negative ratings by emitting invalid calls (the reward hack Cursor reported), since those are
penalized whatever the session's rating.

`ran_out` closes the same kind of hole for the rated behaviour: a user who dislikes how the
agent finishes (a `finish` without running the tests, say) rates sessions that finish, and a
policy that stops calling `finish` escapes every such rating. bench/online.py measured it: an
update that moved the disliked completions 3-7x more than the default one took the probe's
sessions that end in `finish` from 37 of 48 to 14 of 48 in eight cycles, the rest running out
of steps, unrated. A session that runs out is a run the user has to take over, as a cancelled
one is: the same small weight.

`repeated_call` closes the next one. A user who likes test runs (`tests_green`, a thumbs up
on running the tests) rewards every model call of such a session, the ones that ran the
same passing tests again and again included: the twelfth run of bench/online.py ended with
a model that ran `python -m pytest -q` until its step budget was spent, on held-out tasks it
had solved before (calls repeating an earlier call of their session with the same result:
16.5 % -> 23.1 % of its greedy calls; held-out pass@1 22.5 % -> 10.0 %). A call that repeats
one the agent already made, and gets the same result, learns nothing and spends a step: it
is rated -1 with the weight of an explicit rating, on that message only, so that it
outweighs what covers the whole session. "The same result" ignores durations (`in 0.02s`);
a test run after an edit has a different result, or the same one for a reason, and is not a
repeat of the run before the edit unless its output is identical too.

`finished_failing` closes the one after it. A user who likes the tests run before `finish`
rewards the run and the `finish`, whatever the run showed: the twelfth to fourteenth runs
of bench/online.py ended with versions that, on held-out tasks they had solved before, ran
the task's failing command, read the file, then ran `python -m pytest -q` (whose visible
tests passed all along) and called `finish`, with or without an edit (4 of the 9 tasks
those runs lost). Saying "done" while a check one ran is still failing is wrong whoever
rates it: such a `finish` is rated -1 with the weight of an explicit rating, on that
message only. A check is a command that runs code or tests; it counts as fixed only when
the same command later exits 0 (another command passing shows nothing about it).

`check_fixed` is the credit the two before it leave out. A user who likes test runs before
`finish` rates the test run; the task's own check (the command that showed the bug) is rated
only when it fails again (`finished_failing`). The fifteenth run of bench/online.py, with
that signal, still lost held-out tasks the same way: the versions it published learned
`python -m pytest -q` as the rewarded check and ran it *instead of* the task's command, and
the 73 `finished_failing` rows did not teach them to run the task's command again: nothing
rewarded running it. Turning a failing check green is what the user wanted done, whoever
rates it: the run that passed and the edits since the check last failed (the fix, not a
misstep before it) are rated +1 with the weight of an explicit rating, each on its own
message. Only a check that failed before the agent's first edit counts (the workspace as
the user left it): repairing what the agent itself broke earns nothing. A command that
fails on that workspace only because its script does not exist yet would still count once
the agent wrote it; the user's explicit rating overrides it, as any implicit signal.

Not here: the update (`online.py`), the store's schema (`agent_runtime.store.migrations`).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_runtime import names
from agent_runtime.agent import EDITS_FILE, INVALID_CALL
from agent_runtime.approvals import EDIT_TOOLS
from agent_runtime.learning import RATED_SAMPLES_SQL, load_config, workspace_excluded
from agent_runtime.toolcalls import call_key

PLUGIN_WEIGHT = 0.5                 # a source a plugin declares (`register_feedback_sources`)
REWARD_WEIGHTS = {
    names.EXPLICIT: 1.0,
    names.EDIT_KEPT: 0.5,
    names.EDIT_REVERTED: 1.0,
    names.FOLLOWUP_DISSATISFIED: 0.5,
    names.RUN_CANCELLED: 0.25,
    names.PERMISSION_REJECTED: 0.5,
    names.TESTS_GREEN: 0.5,
    names.RAN_OUT: 0.25,
    names.REPEATED_CALL: 1.0,
    names.FINISHED_FAILING: 1.0,
    names.CHECK_FIXED: 1.0,
}
INVALID_CALL_REWARD = -0.5          # at most this for a model call whose tool call did not parse

# rules first: a follow-up that says the agent got it wrong
DISSATISFIED = re.compile(
    r"\b((that'?s|that is|this is|it'?s) (wrong|not (right|it|what i))|"
    r"undo|revert|roll ?back|put it back|not what i (asked|wanted|meant)|"
    r"(did ?n'?t|did not) ask|(does ?n'?t|does not|did ?n'?t|did not) work|you broke|"
    r"broke (it|the)|stop doing|wrong (file|change|fix))\b", re.IGNORECASE)
TEST_COMMAND = re.compile(
    r"(^|[\s/;&|])(pytest|py\.test|unittest|tox|nox|test_\w+\.py|\w+_test\.py|"
    r"npm (run )?test|yarn test|cargo test|go test|make (test|check)|ctest)\b")
CHECK_COMMAND = re.compile(                     # runs code: its failure is a finding
    TEST_COMMAND.pattern + r"|(^|[\s/;&|])(python3?|node|ruby|bash|sh|go run|cargo run|make)\b")


@dataclass
class SignalConfig:
    edit_delay_s: float = 3600.0    # judge edits this long after the session ended, even
                                    # if no later session started in its workspace


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _time(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text)


# -- implicit signals -------------------------------------------------------------------------

def derive_signals(store: Any, config: SignalConfig | None = None) -> int:
    """Add the implicit feedback rows of the user's sessions that ended since the last scan
    (edits once they can be judged); returns how many rows were added."""
    config = config or SignalConfig()
    rows = list(store.db.query(
        "SELECT s.id, s.status, s.workspace, s.updated_at, s.created_at, sc.session_id AS "
        "scanned, sc.edits_done FROM sessions s LEFT JOIN signal_scans sc ON sc.session_id = "
        "s.id WHERE s.origin = ? AND s.status != ? AND (sc.session_id IS NULL OR "
        "sc.edits_done = 0) ORDER BY s.created_at", [names.ORIGIN_USER, names.RUNNING]))
    added = 0
    for s in rows:
        found: list[dict] = [] if s["scanned"] else _turn_signals(store, s)
        edits = _edit_signal(store, s, config)
        if s["scanned"] and edits == "pending":
            continue                               # nothing new: write nothing
        if edits is not None and edits != "pending":
            found += edits
        with store.transaction():
            for f in found:
                store.add_feedback(f["rating"], session_id=s["id"], message_id=f.get("message"),
                                   source=f["source"], comment=f.get("comment"))
            store.record_scan(s["id"], edits_done=edits != "pending")
        added += len(found)
    return added


def _turn_signals(store: Any, session: dict) -> list[dict]:
    """Cancelled or ran-out run, declined calls, dissatisfied follow-ups, repeated calls, a
    green last test run."""
    out: list[dict] = []
    known = {(f["message_id"], f["source"]) for f in store.feedback(session["id"])}
    if session["status"] == names.CANCELLED:
        out.append({"rating": -1, "source": names.RUN_CANCELLED})
    elif session["status"] == names.BUDGET_EXHAUSTED:
        out.append({"rating": -1, "source": names.RAN_OUT})
    calls = store.tool_calls(session["id"])
    for c in calls:
        if (c["result"] or "").startswith(names.DECLINED_PREFIX) \
                and (c["message_id"], names.PERMISSION_REJECTED) not in known:  # e.g. by ACP
            out.append({"rating": -1, "source": names.PERMISSION_REJECTED,
                        "message": c["message_id"], "comment": c["name"]})
    for m in store.messages(session["id"]):
        if m["role"] == "user" and (m["meta"] or {}).get("kind") == names.KIND_USER \
                and DISSATISFIED.search(m["content"] or ""):
            out.append({"rating": -1, "source": names.FOLLOWUP_DISSATISFIED, "message": m["id"],
                        "comment": (m["content"] or "")[:200]})
    out += [{"rating": -1, "source": names.REPEATED_CALL, "message": m, "comment": what}
            for m, what in repeated_calls(calls).items()]
    tests = [c for c in calls if c["name"] == "run_command" and c["ok"]
             and TEST_COMMAND.search(str((c["arguments"] or {}).get("command", "")))]
    if tests and (tests[-1]["data"] or {}).get("exit_code") == 0:
        out.append({"rating": 1, "source": names.TESTS_GREEN,
                    "comment": str(tests[-1]["arguments"].get("command"))[:200]})
    out += [{"rating": -1, "source": names.FINISHED_FAILING, "message": m, "comment": what}
            for m, what in finished_failing(calls).items()]
    out += [{"rating": 1, "source": names.CHECK_FIXED, "message": m, "comment": what}
            for m, what in checks_fixed(calls).items()]
    return out


def _check_run(c: dict) -> tuple[str, int] | None:
    """(command, exit code) of a call that ran a check (`CHECK_COMMAND`), else None."""
    args = c["arguments"] if isinstance(c["arguments"], dict) else {}
    if c["name"] != "run_command" or c["ok"] is None:
        return None
    command = str(args.get("command", "")).strip()
    code = (c["data"] or {}).get("exit_code")
    if not CHECK_COMMAND.search(command) or code is None:
        return None
    return command, code


def finished_failing(calls: list[dict]) -> dict[int, str]:
    """{`finish` message id: the check left failing} for each `finish` called while a check
    the agent ran had failed and was not seen to pass again: the same command, exit 0. A
    check is a command that runs code or tests (`CHECK_COMMAND`); a command that only looks
    (`ls`, `grep`) may fail for the answer it gives. `calls` as for `repeated_calls`."""
    failing: dict[str, int] = {}
    out: dict[int, str] = {}
    for c in calls:
        if (run := _check_run(c)) is not None:
            command, code = run
            if code == 0:
                failing.pop(command, None)
            else:
                failing.setdefault(command, code)
        elif c["name"] == "finish" and failing and c["message_id"] is not None:
            command, code = next(iter(failing.items()))
            out[c["message_id"]] = f"{command[:150]} exited {code}"
    return out


def checks_fixed(calls: list[dict]) -> dict[int, str]:
    """{assistant message id: the check it fixed} for the run that turned a failing check
    green and the edits since that check last failed: a check that failed before the
    agent's first edit (`EDIT_TOOLS`), then exited 0, the same command. `calls` as for
    `repeated_calls`."""
    found: set[str] = set()                        # failed on the workspace as found
    edits: dict[str, list[int]] = {}               # command -> edits since its last failure
    out: dict[int, str] = {}
    edited = False
    for c in calls:
        if c["name"] in EDIT_TOOLS and c["ok"]:
            edited = True
            if c["message_id"] is not None:
                for made in edits.values():
                    made.append(c["message_id"])
        elif (run := _check_run(c)) is not None:
            command, code = run
            if code != 0:
                if not edited:
                    found.add(command)
                if command in found:
                    edits[command] = []
            elif command in edits and edits[command]:
                found.discard(command)             # fixed once: breaking it again and
                what = f"{command[:150]} exited 0"  # repairing it earns nothing
                for m in [*edits.pop(command), c["message_id"]]:
                    if m is not None:
                        out.setdefault(m, what)
    return out


def repeated_calls(calls: list[dict]) -> dict[int, str]:
    """{assistant message id: its first call's tool name} for the model calls all of whose
    tool calls repeat an earlier call of the same session: the same tool, the same
    arguments, the same result (durations aside). `calls` are the session's tool calls in
    order (`SessionStore.tool_calls`); a call that did not parse is penalized as such and
    not counted here."""
    seen: set[str] = set()
    by_message: dict[int, list[bool]] = {}
    names_of: dict[int, str] = {}
    for c in calls:
        if c["name"] == INVALID_CALL or c["message_id"] is None:
            continue
        key = call_key(c["name"], c["arguments"], c["result"])
        by_message.setdefault(c["message_id"], []).append(key in seen)
        names_of.setdefault(c["message_id"], c["name"])
        seen.add(key)
    return {m: names_of[m] for m, repeats in by_message.items() if all(repeats)}


def _edit_signal(store: Any, session: dict, config: SignalConfig) -> list[dict] | str | None:
    """[] / [kept] / [reverted] once judged, "pending" until it can be, None: no edits."""
    path = store.home / "sessions" / session["id"] / EDITS_FILE
    if not path.exists():
        return None
    later = store.db.execute("SELECT 1 FROM sessions WHERE workspace = ? AND created_at > ? "
                             "AND origin = ? LIMIT 1", [session["workspace"],
                                                        session["updated_at"],
                                                        names.ORIGIN_USER]).fetchone()
    aged = (_now() - _time(session["updated_at"])).total_seconds() >= config.edit_delay_s
    if not later and not aged:
        return "pending"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    workspace = Path(record.get("workspace") or session["workspace"])
    files = record.get("files") or {}
    changed = {rel: f for rel, f in files.items() if f.get("before") != f.get("after")}
    if not changed:
        return []
    now = {rel: _sha256(workspace / rel) for rel in changed}
    if all(now[rel] == f["after"] for rel, f in changed.items()):
        return [{"rating": 1, "source": names.EDIT_KEPT, "comment": ", ".join(sorted(changed))}]
    if all(now[rel] == f["before"] for rel, f in changed.items()):
        return [{"rating": -1, "source": names.EDIT_REVERTED,
                 "comment": ", ".join(sorted(changed))}]
    return []


def _sha256(path: Path) -> str | None:
    import hashlib
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


# -- rewards of samples -----------------------------------------------------------------------

def rated_sample_ids(store: Any) -> list[int]:
    """Samples a rating covers that no finished cycle consumed, in workspaces that may be
    learned from (the config's `exclude` is checked again: it may have grown since)."""
    config = load_config(store.home)
    rows = store.db.execute(
        f"SELECT sa.id, s.workspace FROM samples sa JOIN sessions s ON s.id = sa.session_id "
        f"WHERE sa.id IN ({RATED_SAMPLES_SQL}) ORDER BY sa.id").fetchall()
    excluded: dict[str, bool] = {}
    out = []
    for sample_id, workspace in rows:
        if workspace not in excluded:
            excluded[workspace] = bool(workspace) and workspace_excluded(workspace, config)
        if not excluded[workspace]:
            out.append(sample_id)
    return out


def sample_rewards(store: Any, sample_ids: list[int]) -> dict[int, float]:
    """The reward of each sample (see the module docstring); samples nothing covers are
    left out."""
    if not sample_ids:
        return {}
    marks = ",".join("?" * len(sample_ids))
    rows = store.db.execute(
        f"SELECT sa.id, t.rating, t.source, t.target_message_id IS NOT NULL AS specific, "
        f"t.feedback_id FROM samples sa JOIN feedback_targets t ON t.session_id = sa.session_id "
        f"AND (t.target_message_id IS NULL OR t.target_message_id = sa.message_id) "
        f"WHERE sa.id IN ({marks})", sample_ids).fetchall()
    explicit: dict[int, tuple] = {}
    implicit: dict[int, float] = {}
    for sid, rating, source, specific, fid in rows:
        if source == names.EXPLICIT:
            key = (specific, fid)                  # message over session, then the newest
            if sid not in explicit or key > explicit[sid][0]:
                explicit[sid] = (key, float(rating))
        else:
            weight = REWARD_WEIGHTS.get(source, PLUGIN_WEIGHT)
            implicit[sid] = implicit.get(sid, 0.0) + rating * weight
    out = {sid: max(-1.0, min(1.0, r)) for sid, r in implicit.items()}
    out.update({sid: r for sid, (_, r) in explicit.items()})
    for sid in invalid_call_samples(store, sample_ids):
        rated_itself = sid in explicit and explicit[sid][0][0]
        if sid in out and not rated_itself:
            out[sid] = min(out[sid], INVALID_CALL_REWARD)
    return out


def invalid_call_samples(store: Any, sample_ids: list[int]) -> set[int]:
    """The samples among `sample_ids` whose model call wrote a tool call that did not parse."""
    if not sample_ids:
        return set()
    marks = ",".join("?" * len(sample_ids))
    rows = store.db.execute(
        f"SELECT DISTINCT sa.id FROM samples sa JOIN tool_calls c ON c.message_id = sa.message_id "
        f"WHERE c.name = ? AND sa.id IN ({marks})", [INVALID_CALL, *sample_ids]).fetchall()
    return {sid for (sid,) in rows}
