"""The store's part in learning from use: who made a session, exclusion from learning,
feedback sources by name, and migration m003 on a database made before it."""

import sqlite3

import pytest
import sqlite_utils

from agent_runtime import names
from agent_runtime.learning import LearningConfig, load_config, session_learns
from agent_runtime.store import SessionStore
from agent_runtime.store.migrations import MIGRATIONS, migrate


def test_sessions_are_the_users_by_default_and_learnable(store):
    s = store.get_session(store.create_session("t", "w", "m"))
    assert (s["origin"], s["learn"]) == (names.ORIGIN_USER, True)


def test_an_unknown_origin_is_refused(store):
    with pytest.raises(ValueError, match="origin must be one of"):
        store.create_session("t", "w", "m", origin="robot")


def test_listing_hides_eval_and_rollout_sessions_unless_asked(store):
    mine = store.create_session("mine", "w", "m")
    store.create_session("graded", "w", "m", origin=names.ORIGIN_EVAL)
    store.create_session("rollout", "w", "m", origin=names.ORIGIN_ROLLOUT)
    assert [s["id"] for s in store.list_sessions()] == [mine]
    assert len(store.list_sessions(include_all=True)) == 3


def test_a_session_can_be_excluded_from_learning_later(store):
    sid = store.create_session("t", "w", "m")
    store.set_learn(sid, False)
    assert store.get_session(sid)["learn"] is False


def test_every_named_feedback_source_is_declared_to_plugins():
    from agent_runtime.hooks import feedback_sources
    assert set(names.FEEDBACK_SOURCES) <= set(feedback_sources())


def test_graded_sessions_of_an_older_database_become_rollouts(tmp_path):
    path = tmp_path / "apprentice.db"
    db = sqlite_utils.Database(sqlite3.connect(str(path), isolation_level=None))
    db.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    for fn in MIGRATIONS[:2]:                          # the schema before m003
        fn(db)
        db.execute("INSERT INTO _migrations VALUES (?, 'then')", [fn.__name__])
    db.execute("INSERT INTO sessions (id, task, workspace, model, created_at, updated_at) "
               "VALUES ('graded', 't', 'w', 'm', 'x', 'x'), ('mine', 't', 'w', 'm', 'x', 'x')")
    db.execute("INSERT INTO rewards (session_id, task_id, reward, passed, created_at) "
               "VALUES ('graded', 'fix_bug/1', 1.0, 1, 'x')")
    assert "m003_learning_from_use" in migrate(db)
    origins = dict(db.execute("SELECT id, origin FROM sessions").fetchall())
    assert origins == {"graded": names.ORIGIN_ROLLOUT, "mine": names.ORIGIN_USER}


def test_config_defaults_without_a_file(tmp_path):
    assert load_config(tmp_path) == LearningConfig()


def test_config_reads_the_learning_table(tmp_path):
    (tmp_path / "config.toml").write_text("[learning]\nenabled = false\nmin_samples = 3\n")
    config = load_config(tmp_path)
    assert (config.enabled, config.min_samples) == (False, 3)


@pytest.mark.parametrize("text,message", [
    ("[learning]\nmin_sample = 3\n", "unknown setting learning.min_sample"),
    ("[learning]\nmin_samples = 'many'\n", "learning.min_samples must be an integer >= 0"),
    ("[learning]\nschedule_minutes = -1\n", "learning.schedule_minutes must be a number >= 0"),
    ("learning = 3\n", "must be a table"),
    ("[learning]\nexclude = 'x'\n", "learning.exclude must be a list of paths"),
    ("[learning\n", "config.toml")])
def test_a_bad_config_is_a_one_line_error_naming_the_setting(tmp_path, text, message):
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_config(tmp_path)
    assert "\n" not in str(info.value)


def test_a_workspace_opts_out_with_its_marker_file(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".apprentice-no-learn").write_text("")
    assert session_learns(tmp_path, ws) is False


def test_folders_under_an_excluded_workspace_are_excluded(tmp_path):
    (tmp_path / "secret" / "sub").mkdir(parents=True)
    (tmp_path / "config.toml").write_text(f'[learning]\nexclude = ["{tmp_path / "secret"}"]\n')
    assert session_learns(tmp_path, tmp_path / "secret" / "sub") is False


def test_a_store_opened_twice_applies_m003_once(tmp_path):
    SessionStore(tmp_path).close()
    with SessionStore(tmp_path) as s:
        assert s.db.execute("SELECT COUNT(*) FROM _migrations WHERE name = "
                            "'m003_learning_from_use'").fetchone()[0] == 1


def test_a_second_rating_of_the_same_target_replaces_the_first(store):
    sid = store.create_session("t", "ws", "m")
    mid = store.add_message(sid, 0, "assistant", "done")
    up = store.add_feedback(1, session_id=sid)
    on_message = store.add_feedback(1, session_id=sid, message_id=mid)
    signal = store.add_feedback(-1, session_id=sid, source="reverted")
    down = store.add_feedback(-1, session_id=sid, reason="wrong_change")
    rows = {f["id"]: f for f in store.feedback(sid)}
    assert rows[up]["replaced_by"] == down                      # the history stays
    assert rows[on_message]["replaced_by"] is None             # another target
    assert rows[signal]["replaced_by"] is None                 # signals are not the user's toggle
    counted = store.db.execute("SELECT feedback_id FROM feedback_targets ORDER BY feedback_id")
    assert [r[0] for r in counted] == [on_message, signal, down]


def _rated_sample(store):
    sid = store.create_session("t", "w", "m")
    mid = store.add_message(sid, 0, "assistant", "done")
    return store.add_sample(sid, 0, mid, [1], [2], [-1.0], None, 1)


def test_finishing_a_cycle_records_it_and_consumes_its_samples(store):
    sample = _rated_sample(store)
    cycle = store.add_cycle([sample], base_version=1)
    store.finish_cycle(cycle, names.CYCLE_REJECTED, [(sample, 1.0)], gate={"passed": False},
                       samples=1, liked=1, reason="worse")
    row = store.query("SELECT status, samples, liked, gate, reason FROM learner_cycles")[0]
    assert row == {"status": names.CYCLE_REJECTED, "samples": 1, "liked": 1,
                   "gate": '{"passed": false}', "reason": "worse"}
    assert store.query("SELECT sample_id, cycle_id FROM trained_samples") == \
        [{"sample_id": sample, "cycle_id": cycle}]


def test_a_cycle_finished_in_a_rolled_back_transaction_consumes_nothing(store):
    sample = _rated_sample(store)
    cycle = store.add_cycle([sample], base_version=1)
    with pytest.raises(RuntimeError), store.transaction():
        store.finish_cycle(cycle, names.CYCLE_PUBLISHED, [(sample, 1.0)], gate={}, version=2)
        raise RuntimeError("killed before the version was recorded")
    assert store.query("SELECT status FROM learner_cycles") == [{"status": names.CYCLE_RUNNING}]
    assert store.query("SELECT * FROM trained_samples") == []
