"""bench/online.py: the simulated user's taste follows its rules, and a smoke run on a tiny
checkpoint goes through measuring, a round of sessions and a cycle."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_online", ROOT / "bench" / "online.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Task:
    files = {"calc.py": "def add(a, b):\n    return a - b\n"}


def c(name, **arguments):
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize("calls,rating", [
    ([c("run_command", command="python -m pytest -q"), c("finish", summary="ok")], 1),
    ([c("finish", summary="ok"), c("run_command", command="pytest")], 0),   # tests after finish
    ([c("write_file", path="calc.py", content="x"), c("run_command", command="pytest"),
      c("finish", summary="ok")], -1),                                     # rewrote a file
    ([c("write_file", path="new.py", content="x"), c("finish", summary="ok")], 0),  # new file
    ([c("edit_file", path="calc.py", old="-", new="+"), c("finish", summary="ok")], 0)])
def test_the_simulated_user_rates_by_its_rules(calls, rating):
    assert load_bench().taste(Task(), calls) == rating


def test_a_smoke_run_measures_before_and_after(tmp_path, capsys, one_thread, monkeypatch):
    monkeypatch.setenv("APPRENTICE_HOME", str(tmp_path / "ignored"))
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    load_bench().main(["--model", str(ckpt), "--rounds", "1", "--sessions", "1", "--probe", "1",
                       "--eval-n", "1", "--max-steps", "1", "--max-new-tokens", "8",
                       "--gate-tasks", "0", "--concurrency", "1", "--home", str(tmp_path / "h")])
    out = capsys.readouterr().out
    assert "before (v1)" in out and "round 0" in out and "after  (v1)" in out
