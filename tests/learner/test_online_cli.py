"""The commands of learning from use, over a real home: `learn online` without anything to
learn, clean errors, `versions list | show | rollback`, one daemon per home, `sessions list
--all`, `run --no-learn`."""

import fcntl
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from agent_runtime.cli import main
from agent_runtime.store import SessionStore
from learner.versions import VersionStore

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def invoke(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def test_learn_online_with_nothing_rated_prints_the_issue_s_object(home):
    out = json.loads(invoke("learn", "online", "--once", "--json"))
    assert out == {"samples": 0, "liked": 0, "disliked": 0, "version": None,
                   "gate": {"passed": False, "reason": "no rated samples"},
                   "logprob_shift": {"liked": None, "disliked": None}}


def test_learning_turned_off_in_config_runs_no_cycle(home):
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text("[learning]\nenabled = false\n")
    assert "disabled" in invoke("learn", "online", "--once")


def test_a_bad_config_is_a_one_line_error(home):
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text("[learning]\nenabled = 'yes'\n")
    out = invoke("learn", "online", "--once", code=1)
    assert out.startswith("Error: ") and "learning.enabled must be true or false" in out \
        and len(out.strip().splitlines()) == 1


def test_learn_status_of_a_fresh_home_says_off(home):
    assert invoke("learn", "status").startswith("learner off")


@pytest.fixture
def two_versions(home):
    vs = VersionStore(home / "versions")
    first = {"w": torch.arange(8, dtype=torch.bfloat16)}
    vs.publish(first)
    vs.publish({"w": first["w"] + 1})
    return vs


def test_versions_list_marks_the_serving_version(two_versions):
    lines = invoke("versions", "list").splitlines()
    assert [line[:4] for line in lines] == ["  v1", "* v2"]


def test_rollback_serves_the_old_weights_as_a_new_version(two_versions):
    invoke("versions", "rollback", "1")
    vs = VersionStore(two_versions.root)
    assert vs.latest().version == 3 and vs.latest().sha256 == vs.info(1).sha256


def test_show_names_what_made_a_rollback(two_versions):
    invoke("versions", "rollback", "1")
    assert json.loads(invoke("versions", "show", "3"))["meta"] == {"to": 1, "from": 2}


def test_an_unknown_version_is_a_clean_error(two_versions):
    assert "no version 9" in invoke("versions", "show", "9", code=1)


def test_versions_without_a_store_is_a_clean_error(home):
    assert "no versions published" in invoke("versions", "list", code=1)


def test_a_second_daemon_for_the_same_home_refuses_to_start(home):
    (home / "learner").mkdir(parents=True)
    with open(home / "learner" / "daemon.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = invoke("daemon", "--no-serve", code=1)
    assert "already runs for" in out


def run_example(*extra):
    ws = EXAMPLES / "calc"
    return CliRunner().invoke(main, ["run", "Fix the failing test", "-w", str(ws), "--copy",
                                     "--policy", f"replay:{EXAMPLES / 'calc_fix.json'}",
                                     "--json", *extra])


def latest(home):
    with SessionStore(home) as s:
        return s.list_sessions(include_all=True)[0]


def test_run_no_learn_excludes_the_session(home):
    run_example("--no-learn")
    assert latest(home)["learn"] is False


def test_sessions_list_hides_eval_sessions_until_all(home):
    with SessionStore(home) as s:
        s.create_session("graded task", "w", "m", origin="eval")
    assert "graded task" not in invoke("sessions", "list")
    assert "[eval] graded task" in invoke("sessions", "list", "--all")


def test_learning_on_another_model_than_the_version_line_is_a_clean_error(home, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    vs = VersionStore(home / "versions")
    vs.publish({"w": torch.zeros(2)})
    (vs.root / "base.json").write_text(json.dumps({"model": str(tmp_path / "first-model")}))
    with SessionStore(home) as s:
        sid = s.create_session("t", "w", "m")
        mid = s.add_message(sid, 0, "assistant", "x")
        s.add_sample(sid, 0, mid, [1], [2], [-1.0], None, 1)
        s.add_feedback(1, session_id=sid)
    out = invoke("learn", "online", "--once", "--model", other, code=1)
    assert "is the version line of" in out and "first-model" in out
