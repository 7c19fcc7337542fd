"""`apprentice eval` and `apprentice learn tasks export`, and the report they print."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent_runtime.cli import main
from agent_runtime.store import SessionStore
from learner.eval import EvalReport, format_report, resolve_tasks
from learner.rollout import Episode, rewards
from learner.tasks import load_tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))

SUMMARY = re.compile(r"^pass@1 (\d+\.\d)% \((\d+)/(\d+)\)  mean steps (\d+\.\d)  "
                     r"mean tokens (\d+)$")


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result


def episode(task_id, reward, steps, tokens, cheated=False, family="fix_bug"):
    return Episode(task_id, "0123456789abcdef", reward, reward > 0 or cheated, cheated, steps,
                   tokens, "finished", family, "heldout", "passed" if reward else "failed")


def test_the_summary_line_has_pass_at_1_mean_steps_and_mean_tokens():
    report = EvalReport([episode("a", 1.0, 4, 100), episode("b", 0.0, 6, 300),
                         episode("c", 1.0, 5, 200, family="rename_symbol")])
    text = format_report(report)
    assert SUMMARY.match(text).groups() == ("66.7", "2", "3", "5.0", "200")
    verbose = format_report(report, verbose=True).splitlines()
    assert verbose[0].startswith("PASS  a") and verbose[1].startswith("FAIL  b")
    assert any("rename_symbol" in line and "1/1" in line for line in verbose)
    assert SUMMARY.match(verbose[-1])


def test_cheating_is_counted_in_the_summary():
    report = EvalReport([episode("a", 0.0, 3, 50, cheated=True)])
    assert format_report(report).endswith("cheated 1")
    assert format_report(report, verbose=True).startswith("CHEAT")


def test_eval_of_the_oracle_on_held_out_tasks_scores_100(home):
    out = invoke("eval", "--tasks", "sim-heldout", "-n", 4, "--policy", "oracle", "-v")
    assert out.exit_code == 0, out.output
    lines = out.output.strip().splitlines()
    assert sum(line.startswith("PASS") for line in lines) == 4
    m = SUMMARY.match(lines[-1])
    assert m and m.group(1) == "100.0" and m.group(2) == m.group(3) == "4"
    with SessionStore(home) as store:
        assert len(store.list_sessions(include_all=True)) == 4 and len(rewards(store)) == 4


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_the_still_clock_makes_pytest_report_no_time_in_a_tasks_commands(tmp_path, mode):
    """`fixed_clock`: pytest run in a task's commands (sandboxed or not) reports a 0.3 s test as
    taking 0.00 s, so two evaluations print the same tool output; without it, 0.30 s."""
    from agent_runtime.sandbox import Sandbox, SandboxConfig
    from learner.tasks.grading import fixed_clock
    from learner.tasks.repo import TEST_COMMAND, TEST_ENV
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n"
                                            "    time.sleep(0.3)\n")
    env = {**TEST_ENV, "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    for still, expect in ((False, "1 passed in 0.3"), (True, "1 passed in 0.00s")):
        config = SandboxConfig(mode=mode, env=env)
        box = Sandbox(tmp_path, fixed_clock(config) if still else config)
        try:
            out = box.run(TEST_COMMAND).output.strip().splitlines()[-1]
        finally:
            box.close()
        assert out.startswith(expect), out


def test_an_evaluation_stops_pytests_clock_unless_asked_not_to(home):
    """`apprentice eval` runs the tasks' pytest with the still clock: every summary the
    oracle's episodes read says 0.00 s."""
    out = invoke("eval", "--tasks", "sim-heldout", "-n", 2, "--policy", "oracle")
    assert out.exit_code == 0, out.output
    with SessionStore(home) as store:
        texts = [m["content"] for s in store.list_sessions(include_all=True)
                 for m in store.messages(s["id"])
                 if m["role"] == "tool" and " passed in " in (m["content"] or "")]
    assert texts and all(re.search(r"passed in 0\.00s", t) for t in texts), texts


def test_in_a_terminal_eval_shows_its_progress_on_stderr_and_prints_the_same_report(home,
                                                                                  monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")       # rich: treat stderr as a terminal
    args = ["eval", "--tasks", "sim-heldout", "-n", "3", "--policy", "oracle"]
    out = CliRunner().invoke(main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "3/3" in out.stderr and "3 passed" in out.stderr
    assert SUMMARY.match(out.stdout.strip())
    monkeypatch.setenv("TTY_COMPATIBLE", "0")       # a pipe or a log: nothing but the report
    out = CliRunner().invoke(main, args, catch_exceptions=False)
    assert out.stderr == "" and SUMMARY.match(out.stdout.strip())


def test_export_then_eval_the_folders(home, tmp_path):
    out = invoke("learn", "tasks", "export", tmp_path / "tasks", "--split", "heldout", "-n", 3,
                 "--seed", 2, "--with-solution")
    assert out.exit_code == 0 and "wrote 3 task folders" in out.output
    assert len(load_tasks(tmp_path / "tasks")) == 3
    out = invoke("eval", "--tasks", tmp_path / "tasks", "--policy", "oracle")
    assert out.exit_code == 0, out.output
    assert SUMMARY.match(out.output.strip()).group(1) == "100.0"
    one = sorted((tmp_path / "tasks").iterdir())[0]
    out = invoke("eval", "--tasks", one, "--policy", "oracle", "--sandbox", "off")
    assert "(1/1)" in out.output


def test_eval_of_a_user_folder_with_a_replay_policy(home, tmp_path):
    folder = tmp_path / "mine"
    (folder / "repo").mkdir(parents=True)
    (folder / "repo" / "greet.py").write_text("print('helo')\n")
    (folder / "tests").mkdir()
    (folder / "tests" / "check.sh").write_text("python greet.py | grep -qx hello\n")
    (folder / "task.json").write_text(json.dumps(
        {"instruction": "Fix the typo in greet.py.", "test": "bash tests/check.sh", "timeout": 20}))
    script = tmp_path / "fix.json"
    script.write_text(json.dumps([
        "<tool_call>\n" + json.dumps({"name": "edit_file", "arguments": {
            "path": "greet.py", "old": "helo", "new": "hello"}}) + "\n</tool_call>",
        "<tool_call>\n" + json.dumps({"name": "finish", "arguments": {"summary": "fixed"}})
        + "\n</tool_call>"]))
    out = invoke("eval", "--tasks", folder, "--policy", f"replay:{script}", "-v")
    assert out.exit_code == 0, out.output
    assert out.output.startswith("PASS  mine") and "(1/1)" in out.output


def test_the_oracle_refuses_folders_without_a_plan(home, tmp_path):
    invoke("learn", "tasks", "export", tmp_path / "t", "-n", 1)
    out = invoke("eval", "--tasks", tmp_path / "t", "--policy", "oracle")
    assert out.exit_code != 0 and "only solves generated tasks" in out.output


def test_bad_task_specs_are_usage_errors(home, tmp_path):
    out = invoke("eval", "--tasks", tmp_path / "missing", "--policy", "oracle")
    assert out.exit_code == 2 and "sim-heldout" in out.output
    out = invoke("learn", "tasks", "export", tmp_path / "x", "--families", "nope")
    assert out.exit_code == 2 and "unknown families" in out.output


def test_resolve_tasks_draws_simulated_sets_and_limits_folders(tmp_path):
    assert {t.split for t in resolve_tasks("sim-train", 3)} == {"train"}
    assert len(resolve_tasks("sim-heldout")) == 50
    invoke("learn", "tasks", "export", tmp_path, "-n", 4)
    assert len(resolve_tasks(str(tmp_path), 2)) == 2


def test_json_output_has_the_numbers_and_every_episode(home):
    out = CliRunner().invoke(main, ["eval", "-n", "2", "--policy", "oracle", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["n"] == len(data["episodes"]) == 2
    assert data["solved"] == sum(e["reward"] > 0 for e in data["episodes"]) == 2
    assert sum(f["n"] for f in data["by_family"].values()) == 2


def test_free_calls_evaluates_without_the_call_grammar(tmp_path):
    from fake_policies import GrammarTaker
    from learner.eval import evaluate
    tasks = resolve_tasks("sim-heldout", 1, 0, None)
    seen = {}
    for constrain, references in ((True, False), (True, True), (False, False)):
        policy = GrammarTaker()
        with SessionStore(tmp_path / f"home-{constrain}-{references}") as store:
            evaluate(tasks, lambda _t: policy, store, sandbox="off", constrain_calls=constrain,
                     check_references=references)
        seen[constrain, references] = policy.grammars
    assert seen[True, False] and all(g is not None and g.view is None
                                     for g in seen[True, False])
    assert seen[True, True] and all(g is not None and g.view is not None
                                    for g in seen[True, True])
    assert seen[False, False] and all(g is None for g in seen[False, False])


def test_pass_at_k_counts_tasks_any_sample_solved():
    report = EvalReport([episode("a", 1.0, 4, 100), episode("a", 0.0, 6, 300),
                         episode("b", 0.0, 5, 200), episode("b", 0.0, 5, 200),
                         episode("c", 1.0, 3, 90, family="rename_symbol"),
                         episode("c", 1.0, 3, 90, family="rename_symbol")], samples=2)
    assert report.pass_at_1 == 0.5 and report.pass_at_k == 2 / 3
    assert report.tasks_solved() == {"fix_bug": (1, 2), "rename_symbol": (1, 1)}
    text = format_report(report, verbose=True)
    assert text.splitlines()[-1].endswith("  pass@2 66.7% (2/3 tasks)")
    assert SUMMARY.match(text.splitlines()[-1].split("  pass@2")[0])
    assert any(line.split() == ["fix_bug", "1/4", "pass@2", "1/2"] for line in text.splitlines())
    data = report.to_dict()
    assert data["samples"] == 2 and data["tasks_solved"]["fix_bug"] == {"solved": 1, "tasks": 2}
    assert "samples" not in EvalReport(report.episodes[:1]).to_dict()


def test_samples_run_each_task_that_many_times(home):
    out = CliRunner().invoke(main, ["eval", "-n", "2", "--policy", "oracle", "--samples", "2",
                                    "--temperature", "1", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    ids = [e["task_id"] for e in data["episodes"]]
    assert len(ids) == 4 and len(set(ids)) == 2 and ids[0] == ids[1]
    assert data["pass_at_k"] == 1.0 and data["samples"] == 2


def test_samples_need_a_temperature_and_compare_stays_greedy(home):
    out = invoke("eval", "-n", 1, "--policy", "oracle", "--samples", 3)
    assert out.exit_code == 2 and "--temperature" in out.output
    out = invoke("eval", "-n", 1, "--compare", "sft,default", "--samples", 2,
                 "--temperature", 1)
    assert out.exit_code == 2 and "greedily" in out.output


def test_the_temperature_reaches_the_model(tmp_path):
    from tiny_checkpoints import save_tiny_agent_checkpoint
    from learner.eval import policy_factory
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    for temperature in (0.0, 0.7):
        policy = policy_factory(str(path), 16, 0, temperature)(None)
        assert policy.policy.config.temperature == temperature
        # a fixed seed would give every sample of a task the same first call
        assert policy.policy.config.seed == (0 if temperature == 0 else None)


def test_quantize_reaches_the_model_and_needs_one(tmp_path, home):
    from tiny_checkpoints import save_tiny_agent_checkpoint
    from learner.eval import policy_factory
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    model = policy_factory(str(path), 16, 0, 0.0)(None).policy.model
    assert getattr(model, "quantized", None) is None
    model = policy_factory("default", 16, 0, 0.0, "int8")(None).policy.model    # bf16
    assert model.quantized == "int8" and model.lm_head.q is not None
    out = invoke("eval", "-n", 1, "--model", path, "--quantize", "int8")   # a float32 model
    assert out.exit_code == 1 and "serve bfloat16 models" in out.output
    out = invoke("eval", "-n", 1, "--policy", "oracle", "--quantize", "int8")
    assert out.exit_code == 1 and "--quantize needs a model" in out.output
    out = invoke("eval", "-n", 1, "--compare", "sft,default", "--quantize", "int8")
    assert out.exit_code == 2 and "one model at a time" in out.output
