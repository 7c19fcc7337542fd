"""bench/online.py: the simulated user's taste follows its rules, and a smoke run on a tiny
checkpoint goes through measuring, a round of sessions and a cycle."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402


def load_bench(name: str = "online"):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Task:
    files = {"calc.py": "def add(a, b):\n    return a - b\n"}


def c(message_id, name, exit_code=0, **arguments):
    return {"message_id": message_id, "name": name, "arguments": arguments, "ok": True,
            "data": {"exit_code": exit_code} if name == "run_command" else {}}


@pytest.mark.parametrize("calls,rating,messages", [
    ([c(1, "run_command", command="pytest"), c(2, "run_command", command="python -m pytest -q"),
      c(3, "finish", summary="ok")], 1, [(1, 1), (3, 1)]),               # the first test run
                                                                          # and the finish
    ([c(1, "run_command", command="pytest"), c(2, "edit_file", path="calc.py", old="-", new="+"),
      c(3, "run_command", command="pytest"), c(4, "run_command", command="pytest"),
      c(5, "finish", summary="ok")], 1, [(3, 1), (5, 1)]),               # the run after the
                                                                          # edit, not its repeat
    ([c(1, "run_command", command="pytest"), c(2, "edit_file", path="calc.py", old="-", new="+"),
      c(3, "finish", summary="ok")], 1, [(1, 1), (3, 1)]),               # none after the edit
    ([c(1, "run_command", command="python -c 'import calc'", exit_code=1),
      c(2, "run_command", command="pytest"), c(3, "finish", summary="ok")], 1,
     [(2, 1)]),                                                           # a check left failing:
                                                                          # no thumbs on "done"
    ([c(1, "finish", summary="ok"), c(2, "run_command", command="pytest")], 0,
     [(1, -1)]),                                                          # tests after finish
    ([c(1, "write_file", path="calc.py", content="x"), c(2, "run_command", command="pytest"),
      c(3, "write_file", path="calc.py", content="y"), c(3, "finish", summary="ok")], -1,
     [(1, -1), (3, -1)]),                                                 # rewrote a file
    ([c(1, "write_file", path="new.py", content="x"), c(2, "finish", summary="ok")], 0,
     [(2, -1)]),                                                          # a new file is fine
    ([c(1, "edit_file", path="calc.py", old="-", new="+")], 0, [])])      # never finished
def test_the_simulated_user_rates_by_its_rules(calls, rating, messages):
    assert load_bench().taste(Task(), calls) == (rating, messages)


def test_message_ratings_cover_only_the_messages_they_name(tmp_path):
    """What `--rate messages` records reaches only the samples of the rated model calls."""
    from agent_runtime.store import SessionStore
    from learner.sentiment import rated_sample_ids, sample_rewards
    store = SessionStore(tmp_path)
    sid = store.create_session("task", str(tmp_path), "m", 1)
    mids = []
    for i in range(3):
        mids.append(store.add_message(sid, 0, "assistant", f"turn {i}"))
        store.add_sample(sid, 0, mids[-1], [1, 2], [3 + i], [-0.5], None, 1)
        store.add_message(sid, 0, "tool", "ok", name="run_command")
    store.set_status(sid, "finished")
    load_bench().rate(store, sid, 1, [(mids[1], 1)], "messages")
    ids = rated_sample_ids(store)
    assert len(ids) == 1 and sample_rewards(store, ids) == {ids[0]: 1.0}
    assert store.samples_by_id(ids)[0]["message_id"] == mids[1]


def test_a_smoke_run_measures_before_and_after(tmp_path, capsys, one_thread, monkeypatch):
    monkeypatch.setenv("APPRENTICE_HOME", str(tmp_path / "ignored"))
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    load_bench().main(["--model", str(ckpt), "--rounds", "1", "--sessions", "1", "--probe", "1",
                       "--eval-n", "1", "--max-steps", "1", "--max-new-tokens", "8",
                       "--gate-tasks", "0", "--concurrency", "1", "--practice-tasks", "1",
                       "--home", str(tmp_path / "h")])
    out = capsys.readouterr().out
    # its one session runs out of its one step: `ran_out` rates it, so the cycle publishes v2
    assert "before (v1)" in out and "round 0" in out and "after  (v2)" in out
    assert re.search(r"\+ \d+ practice samples \(\d of 1 tasks passed\)", out)
    # bench/online_replay.py replays that cycle offline, every weight and the experts alone
    load_bench("online_replay").main(["--home", str(tmp_path / "h"), "--model", str(ckpt),
                                      "--heldout-tasks", "2", "--trainable", "experts,all"])
    out = capsys.readouterr().out
    assert re.search(r"^1 cycles, [1-9]\d* samples; [1-9]\d* held-out oracle episodes", out, re.M)
    assert re.search(r"^experts cycle 1: [1-9]\d* samples, moved \S+: loss \d", out, re.M)
    assert re.search(r"^all after 1 cycles: loss \d", out, re.M)
    assert out.strip().splitlines()[-1].startswith("loss drift per held-out assistant token: "
                                                   "experts ")
