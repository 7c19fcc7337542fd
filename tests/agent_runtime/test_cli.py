"""`apprentice run / sessions / feedback`: thin commands over the library."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from agent_runtime.cli import main
from agent_runtime.store import SessionStore

ROOT = Path(__file__).resolve().parents[2]
FIX = str(ROOT / "examples" / "calc_fix.json")


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "calc"
    shutil.copytree(ROOT / "examples" / "calc", ws)
    return ws


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def latest_session(home):
    with SessionStore(home) as store:
        return store.list_sessions(1)[0]


def test_every_command_has_help_text():
    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, path + [name])

    for path, command in walk(main, []):
        assert command.help, f"`apprentice {' '.join(path)}` has no help text"
        assert invoke(*path, "--help").exit_code == 0
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"option {param.name} of `apprentice {' '.join(path)}`"


def test_the_readme_command_fixes_the_example_and_feedback_lands_in_the_store(home, workspace):
    env = dict(os.environ, APPRENTICE_HOME=str(home))
    proc = subprocess.run([sys.executable, "-m", "agent_runtime.cli", "run", "Fix the failing test",
                           "-w", str(workspace), "--policy", f"replay:{FIX}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "▸ edit_file" in proc.stdout and "all tests passed" in proc.stdout
    assert "finished" in proc.stdout
    assert subprocess.run([sys.executable, "test_calc.py"], cwd=workspace).returncode == 0
    session = latest_session(home)
    with SessionStore(home) as store:
        sid = session["id"]
        assert len(store.tool_calls(sid)) == 5 and len(store.samples(sid)) == 4
        assistant = next(m["id"] for m in store.messages(sid) if m["role"] == "assistant")
    out = invoke("feedback", sid[:8], "down", "--message", assistant, "--reason", "wrong_change",
                 "--comment", "too eager")
    assert out.exit_code == 0, out.output
    with SessionStore(home) as store:
        (row,) = store.feedback(sid)
    assert (row["rating"], row["message_id"], row["reason"], row["comment"], row["source"]) == \
        (-1, assistant, "wrong_change", "too eager", "explicit")


def test_run_exits_non_zero_when_the_agent_did_not_finish(home, workspace, tmp_path):
    script = tmp_path / "loop.json"
    script.write_text(json.dumps([call("list_files")] * 5))
    out = invoke("run", "task", "-w", workspace, "--policy", f"replay:{script}", "--max-steps", 2)
    assert out.exit_code == 2 and "budget_exhausted" in out.output
    script.write_text(json.dumps([call("list_files")]))
    assert invoke("run", "task", "-w", workspace, "--policy", f"replay:{script}").exit_code == 1


def test_json_output_is_one_event_per_line_ending_with_the_result(home, workspace):
    out = invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}", "--json")
    events = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = {e["event"] for e in events}
    assert {"text", "message", "tool_start", "tool_end", "result"} <= kinds
    assert events[-1]["event"] == "result" and events[-1]["status"] == "finished"


def test_copy_leaves_the_workspace_untouched(home, workspace):
    before = (workspace / "calc.py").read_text()
    out = invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}", "--copy")
    assert out.exit_code == 0 and (workspace / "calc.py").read_text() == before
    copied = Path(latest_session(home)["workspace"])
    assert copied.parent == home / "workspaces" and "a + b" in (copied / "calc.py").read_text()


def test_the_sandbox_fallback_warning_goes_to_stderr(home, workspace, monkeypatch):
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    out = invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}")
    assert out.exit_code == 0 and "WITHOUT a sandbox" in out.stderr
    assert "WITHOUT a sandbox" not in out.stdout


def test_sessions_list_and_show_find_a_session_by_prefix(home, workspace):
    invoke("run", "Fix the failing test", "-w", workspace, "--policy", f"replay:{FIX}")
    sid = latest_session(home)["id"]
    listed = invoke("sessions", "list")
    assert sid[:12] in listed.output and "finished" in listed.output
    assert sid[:12] in invoke("sessions").output                     # bare `sessions` lists
    shown = invoke("sessions", "show", sid[:6])
    assert shown.exit_code == 0 and "Fix the failing test" in shown.output
    assert "▸ edit_file" in shown.output and "#3 assistant" in shown.output
    record = json.loads(invoke("sessions", "show", sid, "--json").output)
    assert record["session"]["id"] == sid and len(record["tool_calls"]) == 5


def test_a_session_whose_process_was_killed_is_listed_as_interrupted(home):
    code = ("import sys, time; from agent_runtime.store import SessionStore; "
            "print(SessionStore(sys.argv[1]).create_session('killed task', 'w', 'm'), flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sid = proc.stdout.readline().strip()
    assert "running" in invoke("sessions", "list").output           # its process is alive
    proc.kill()
    proc.wait()
    listed = invoke("sessions", "list").output
    assert sid[:12] in listed and "interrupted" in listed and "running" not in listed
    assert "interrupted: its process is gone" in invoke("sessions", "show", sid).output


def test_unknown_session_and_bad_reason_are_clean_errors(home, workspace):
    assert "no session matching" in invoke("sessions", "show", "nope").output
    invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}")
    sid = latest_session(home)["id"]
    out = invoke("feedback", sid, "up", "--reason", "because")
    assert out.exit_code == 2 and "because" in out.output
    assert invoke("feedback", sid, "up", "--message", 999999).exit_code == 1


def test_rating_a_tool_result_is_one_line_naming_the_call_to_rate(home, workspace):
    invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}")
    sid = latest_session(home)["id"]
    with SessionStore(home) as store:
        messages = store.messages(sid)
    result = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    call = max(m["id"] for m in messages[:result] if m["role"] == "assistant")
    out = invoke("feedback", sid, "up", "--message", messages[result]["id"])
    assert out.exit_code == 1 and out.output.count("\n") == 1
    assert f"rate the assistant message #{call} before it" in out.output
    with SessionStore(home) as store:
        assert store.feedback(sid) == []


def test_rating_again_replaces_the_earlier_rating_and_says_so(home, workspace):
    invoke("run", "Fix it", "-w", workspace, "--policy", f"replay:{FIX}")
    sid = latest_session(home)["id"]
    first = invoke("feedback", sid, "up").output
    assert "replaces" not in first
    second = invoke("feedback", sid, "down").output
    assert f"(replaces #{first.split()[2].rstrip(':')}: up)" in second


def test_sessions_resume_continues_and_finishes(home, workspace, tmp_path):
    script = tmp_path / "two.json"
    script.write_text(json.dumps([call("list_files")] * 2))
    invoke("run", "task", "-w", workspace, "--policy", f"replay:{script}", "--max-steps", 1)
    sid = latest_session(home)["id"]
    script.write_text(json.dumps([call("finish", summary="resumed and done")]))
    out = invoke("sessions", "resume", sid[:10], "--policy", f"replay:{script}",
                 "--message", "please wrap up")
    assert out.exit_code == 0 and "resumed and done" in out.output
    assert latest_session(home)["status"] == "finished"


def test_bare_apprentice_with_options_goes_to_the_tui():
    result = CliRunner().invoke(main, ["--max-steps", "3", "--help"])
    assert result.exit_code == 0
    assert "tui [OPTIONS]" in result.output and "--policy" in result.output


@pytest.mark.parametrize("task", ["", "   ", "\n\t"])
def test_an_empty_task_is_refused_before_anything_runs(home, workspace, task):
    before = sorted(p.name for p in workspace.rglob("*"))
    result = CliRunner().invoke(main, ["run", task, "-w", str(workspace), "--copy",
                                       "--policy", f"replay:{FIX}"])
    assert result.exit_code == 2 and "TASK is empty" in result.output
    assert sorted(p.name for p in workspace.rglob("*")) == before
    assert not (home / "workspaces").exists()
    with SessionStore(home) as store:
        assert store.list_sessions(5) == []


@pytest.mark.parametrize("command", [["run", "fix it"], ["eval", "-n", "1"], ["tui"], ["acp"],
                                     ["mcp"], ["learn", "grpo", "--tasks", "toy"]])
def test_a_missing_or_broken_model_is_one_line_and_a_non_zero_exit(home, tmp_path, command):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "config.json").write_text("{not json")
    for model, why in ((tmp_path / "missing", "no config.json"),
                       (broken, "model_type 'gpt2' is not supported"),
                       (unreadable, "not valid JSON")):
        result = CliRunner().invoke(main, command + ["--model", str(model)])
        assert result.exit_code == 1, (command, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error:") and why in lines[0], lines
    assert not (home / "runs").exists()           # `learn grpo` left no run folder behind


def test_only_commands_that_take_policy_suggest_it_when_the_default_model_is_missing(
        home, workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_DEFAULT_MODEL", str(tmp_path / "empty"))
    run = CliRunner().invoke(main, ["run", "fix it", "-w", str(workspace)])
    grpo = CliRunner().invoke(main, ["learn", "grpo", "--tasks", "toy"])
    for result in (run, grpo):
        assert result.exit_code == 1 and f"no default model at {tmp_path / 'empty'}" in \
            " ".join(result.output.split())
    assert "--policy replay:FILE" in run.output and "--policy" not in grpo.output


def test_a_replay_file_with_bad_json_is_named_in_the_error(home, workspace, tmp_path):
    bad = tmp_path / "script.json"
    bad.write_text('[{"content": "x"')
    result = CliRunner().invoke(main, ["run", "fix it", "-w", str(workspace),
                                       "--policy", f"replay:{bad}"])
    assert result.exit_code == 1
    assert f"{bad}: not valid JSON" in " ".join(result.output.split())


def test_quantize_needs_a_model_not_a_replay_script(home, workspace):
    result = invoke("run", "fix it", "-w", workspace, "--policy", f"replay:{FIX}",
                    "--quantize", "int8")
    assert result.exit_code == 2 and "--quantize needs a model" in result.output


def test_sessions_clean_removes_copies_but_not_one_in_use(home, workspace):
    for _ in range(2):
        assert invoke("run", "Fix the failing test", "-w", workspace, "--copy",
                      "--policy", f"replay:{FIX}").exit_code == 0
    copies = sorted((home / "workspaces").iterdir())
    assert len(copies) == 2
    with SessionStore(home) as store:            # a session still running in the second copy
        busy = store.sessions_in(copies[1].resolve())[0]["id"]
        store.set_status(busy, "running")
    assert "would remove" in invoke("sessions", "clean", "--dry-run").output
    assert len(list((home / "workspaces").iterdir())) == 2
    assert "1 copy to remove" in invoke("sessions", "clean", "--older-than", "0",
                                        "--dry-run").output
    kept = invoke("sessions", "clean", "--older-than", "1")
    assert "0 copies removed" in kept.output                # both started today
    out = invoke("sessions", "clean").output
    assert f"removed {copies[0].name}" in out and f"in use   {copies[1].name}" in out
    assert sorted((home / "workspaces").iterdir()) == [copies[1]]
    assert (workspace / "calc.py").exists()                  # the original is never touched
    with SessionStore(home) as store:
        assert len(store.list_sessions()) == 2               # sessions stay listed
