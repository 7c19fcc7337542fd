"""The agent loop, driven end to end by the shipped replay policy on real files and SQLite."""

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent_runtime.agent import Agent, AgentConfig, Callbacks
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore
from agent_runtime.tools.base import ToolResult
from agent_runtime.tools.registry import default_tools

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FINISH = call("finish", summary="done")


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "calc"
    shutil.copytree(EXAMPLES / "calc", ws)
    return ws


def run(script, store, workspace, tools=None, **config):
    agent = Agent(ReplayPolicy(script), tools if tools is not None else default_tools(), store,
                  workspace, config=AgentConfig(**config))
    return agent, agent.run("Fix the failing test")


def tool_messages(store, session_id):
    return [m for m in store.messages(session_id) if m["role"] == "tool"]


class Sleepy:
    """A tool that sleeps and logs when it ran (fakes live in the test)."""
    description = "sleep"
    parameters = {"type": "object", "properties": {"tag": {"type": "string"}}, "required": ["tag"]}

    def __init__(self, name, mutates, log, seconds=0.2):
        self.name, self.mutates, self.log, self.seconds = name, mutates, log, seconds

    def __call__(self, args, ctx):
        start = time.perf_counter()
        time.sleep(self.seconds)
        self.log.append((args["tag"], start, time.perf_counter()))
        return ToolResult(f"slept {args['tag']}")


def test_scripted_run_fixes_the_calc_example_and_records_everything(store, workspace):
    script = json.loads((EXAMPLES / "calc_fix.json").read_text())
    agent, result = run(script, store, workspace)
    assert result.status == "finished" and result.ok
    assert subprocess.run([sys.executable, "test_calc.py"], cwd=workspace).returncode == 0
    session = store.get_session(result.session_id)
    assert session["status"] == "finished" and "Fixed `add`" in session["summary"]
    calls = store.tool_calls(result.session_id)
    assert [c["name"] for c in calls] == ["read_file", "read_file", "edit_file", "run_command",
                                          "finish"]
    assert all(c["ok"] for c in calls)
    samples = store.samples(result.session_id)
    assert len(samples) == result.steps == len(script)
    decoded = [agent.policy.tokenizer.decode(s["completion_ids"]) for s in samples]
    assert decoded == script


def test_malformed_calls_come_back_as_tool_errors_and_the_loop_goes_on(store, workspace):
    script = ['<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>',
              call("read_fil", path="calc.py"),
              call("edit_file", path="calc.py", old="a - b"),
              call("read_file", path=3),
              FINISH]
    _, result = run(script, store, workspace)
    assert result.status == "finished"
    errors = [m["content"] for m in tool_messages(store, result.session_id)][:4]
    assert "not valid JSON" in errors[0]
    assert "no tool named 'read_fil'" in errors[1]
    assert "missing required argument 'new'" in errors[2]
    assert "'path' must be of type string" in errors[3]
    assert all(c["ok"] is False for c in store.tool_calls(result.session_id)[:4])


def test_a_turn_without_tool_calls_is_nudged_to_continue(store, workspace):
    _, result = run(["I think the bug is in add.", FINISH], store, workspace)
    kinds = [(m["role"], (m["meta"] or {}).get("kind")) for m in store.messages(result.session_id)]
    assert ("user", "nudge") in kinds and result.status == "finished"


def test_spending_the_step_budget_ends_the_run_as_budget_exhausted(store, workspace):
    _, result = run([call("list_files")] * 10, store, workspace, max_steps=3)
    assert (result.status, result.steps) == ("budget_exhausted", 3)
    assert store.get_session(result.session_id)["status"] == "budget_exhausted"


def test_the_same_calls_with_the_same_results_four_turns_in_a_row_end_the_run(store, workspace):
    """OpenHands' stuck detector: nothing the model saw changed for `stuck_after` turns, so
    the run ends ("failed", the reason in its summary) instead of spending its budget."""
    _, result = run([call("read_file", path="nope.py")] * 10, store, workspace)
    assert (result.status, result.steps) == ("failed", 4)
    assert result.summary.startswith("stuck: the same tool calls got the same results 4 turns")
    assert store.get_session(result.session_id)["status"] == "failed"
    _, result = run([call("read_file", path="nope.py")] * 10, store, workspace, stuck_after=0,
                    max_steps=6)
    assert (result.status, result.steps) == ("budget_exhausted", 6)
    _, result = run([call("list_files"), call("read_file", path="calc.py")] * 5, store,
                    workspace, max_steps=8)          # turns that differ: never stuck
    assert (result.status, result.steps) == ("budget_exhausted", 8)
    script = [call("read_file", path="nope.py")] * 3 + ["Hmm."] + [call("read_file", path="nope.py")] * 3
    _, result = run(script + [FINISH], store, workspace)     # a turn without calls breaks a run
    assert result.status == "finished"


def test_a_command_whose_output_differs_only_in_its_timing_is_the_same_result(store, workspace):
    """A test run prints a new duration every time (`1 passed in 0.02s`): rerunning it with
    nothing changed is still stuck, as the learner's `repeated_call` signal already counts it."""
    timed = call("run_command", command="python -c \"import time; print(f'ok in {time.time()}s')\"")
    _, result = run([timed] * 10, store, workspace)
    outputs = [m["content"] for m in tool_messages(store, result.session_id)]
    assert len(set(outputs)) == len(outputs) == 4                  # four different timings
    assert (result.status, result.steps) == ("failed", 4)


def test_running_out_of_script_fails_the_session_with_the_reason(store, workspace):
    _, result = run([call("list_files")], store, workspace)
    assert result.status == "failed" and "ReplayExhausted" in result.summary
    assert store.get_session(result.session_id)["status"] == "failed"


def test_cancel_stops_the_run_before_the_next_model_call(store, workspace):
    agent = Agent(ReplayPolicy([call("list_files")] * 5), default_tools(), store, workspace)
    agent.callbacks = Callbacks(on_tool_end=lambda c, o: agent.cancel())
    result = agent.run("task")
    assert (result.status, result.steps) == ("cancelled", 1)
    assert store.get_session(result.session_id)["status"] == "cancelled"


def test_cancel_mid_turn_records_the_calls_that_did_not_run(store, workspace):
    log = []
    tools = [Sleepy("poke", True, log, 0.01), *default_tools()]
    agent = Agent(ReplayPolicy([call("poke", tag="1") + call("poke", tag="2"), FINISH]), tools,
                  store, workspace)
    agent.callbacks = Callbacks(on_tool_start=lambda c: agent.cancel())
    result = agent.run("task")
    assert result.status == "cancelled" and [t for t, *_ in log] == ["1"]
    rows = store.tool_calls(result.session_id)
    assert [(r["ok"], r["result"][:7]) for r in rows] == [(True, "slept 1"), (False, "Not run")]
    assert len(tool_messages(store, result.session_id)) == 2


def test_read_only_calls_of_one_turn_run_concurrently(store, workspace):
    log = []
    tools = [Sleepy("nap", False, log), *default_tools()]
    turn = call("nap", tag="a") + call("nap", tag="b") + call("nap", tag="c")
    _, result = run([turn, FINISH], store, workspace, tools=tools)
    (_, s1, e1), (_, s2, e2), (_, s3, e3) = sorted(log)
    assert max(s1, s2, s3) < min(e1, e2, e3)              # all three were asleep at once
    assert result.status == "finished"


def test_mutating_calls_run_alone_and_in_order(store, workspace):
    log = []
    tools = [Sleepy("nap", False, log, 0.05), Sleepy("poke", True, log, 0.05), *default_tools()]
    turn = "".join(call(n, tag=t) for n, t in [("poke", "1"), ("nap", "2"), ("nap", "3"),
                                                ("poke", "4"), ("poke", "5")])
    _, result = run([turn, FINISH], store, workspace, tools=tools)
    by_tag = {tag: (s, e) for tag, s, e in log}
    assert by_tag["1"][1] <= min(by_tag["2"][0], by_tag["3"][0])    # write before the reads
    assert max(by_tag["2"][1], by_tag["3"][1]) <= by_tag["4"][0] <= by_tag["4"][1] <= by_tag["5"][0]
    results = [m["content"] for m in tool_messages(store, result.session_id)]
    assert results[:5] == [f"slept {t}" for t in "12345"]          # results in call order


def test_a_read_after_a_write_in_the_same_turn_sees_the_write(store, workspace):
    turn = call("write_file", path="new.txt", content="fresh") + call("read_file", path="new.txt")
    _, result = run([turn, FINISH], store, workspace)
    assert "fresh" in tool_messages(store, result.session_id)[1]["content"]


def test_a_crashing_tool_becomes_an_error_message_not_a_crash(store, workspace):
    class Broken:
        name, description, mutates = "broken", "always fails", False
        parameters = {"type": "object", "properties": {}}

        def __call__(self, args, ctx):
            raise RuntimeError("kaboom")

    _, result = run([call("broken"), FINISH], store, workspace, tools=[Broken(), *default_tools()])
    first = store.tool_calls(result.session_id)[0]
    assert result.status == "finished" and first["ok"] is False and "kaboom" in first["result"]
    assert "Traceback" in first["data"]["traceback"]


def test_each_step_is_committed_before_the_next_model_call(store, workspace, tmp_path):
    seen = []

    def peek(_text):                     # runs inside policy.complete: look with another connection
        with SessionStore(tmp_path / "home") as other:
            sid = other.list_sessions(1)[0]["id"]
            seen.append((len(other.tool_calls(sid)), len(tool_messages(other, sid)),
                         len(other.samples(sid))))

    agent = Agent(ReplayPolicy([call("list_files") + call("read_file", path="calc.py"),
                                call("read_file", path="test_calc.py"), FINISH]),
                  default_tools(), store, workspace, callbacks=Callbacks(on_text=peek))
    agent.run("task")
    firsts = [seen[0]] + [s for prev, s in zip(seen, seen[1:]) if s != prev]
    assert firsts == [(0, 0, 0), (2, 2, 1), (3, 3, 2)]


def test_resume_continues_the_same_session_with_its_context(store, workspace):
    _, first = run([call("read_file", path="calc.py"), call("list_files")], store, workspace,
                   max_steps=2)
    assert first.status == "budget_exhausted"
    policy = ReplayPolicy([FINISH])
    result = Agent(policy, default_tools(), store, workspace).resume(first.session_id)
    assert (result.session_id, result.status) == (first.session_id, "finished")
    prompt = policy.tokenizer.decode(store.samples(first.session_id)[-1]["prompt_ids"])
    assert "return a - b" in prompt and "Fix the failing test" in prompt    # earlier turns are back
    assert store.get_session(first.session_id)["status"] == "finished"


def test_resume_answers_the_calls_a_crash_left_unfinished(store, workspace):
    sid = store.create_session("task", str(workspace), "replay")
    store.add_message(sid, 0, "system", "sys")
    store.add_message(sid, 0, "user", "task", meta={"kind": "task"})
    entries = [{"id": f"c{i}", "type": "function",
                "function": {"name": "list_files", "arguments": {}}} for i in range(2)]
    mid = store.add_message(sid, 0, "assistant", "", tool_calls=entries)
    store.add_tool_call(sid, mid, "c0", "list_files", {})          # c0 started, c1 never did
    result = Agent(ReplayPolicy([FINISH]), default_tools(), store, workspace).resume(sid)
    assert result.status == "finished"
    calls = store.tool_calls(sid)
    assert [(c["call_id"], c["ok"]) for c in calls[:2]] == [("c0", False), ("c1", False)]
    answered = [m for m in tool_messages(store, sid) if m["tool_call_id"] in ("c0", "c1")]
    assert len(answered) == 2 and all("stopped before this call" in m["content"] for m in answered)


def test_callbacks_see_text_messages_tools_and_samples(store, workspace):
    events = []
    cb = Callbacks(on_text=lambda t: events.append("text"),
                   on_message=lambda i, m: events.append(m["role"]),
                   on_tool_start=lambda c: events.append("start"),
                   on_tool_end=lambda c, o: events.append("end"),
                   on_sample=lambda i, c: events.append("sample"))
    Agent(ReplayPolicy(["Looking.\n" + FINISH]), default_tools(), store, workspace,
          callbacks=cb).run("task")
    assert events == ["text", "text", "text", "text", "sample", "assistant", "start", "tool", "end"]


garbage = st.lists(st.one_of(
    st.text(max_size=20),
    st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",",
                     '"read_file"', '"edit_file"', '"path"', '"calc.py"', "[", "]", "null", "3"]),
), max_size=25).map("".join)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(garbage, min_size=1, max_size=3))
def test_fuzzed_turns_never_crash_the_loop(tmp_path, turns):
    home = tmp_path / f"h{threading.get_ident()}{time.perf_counter_ns()}"
    ws = home / "ws"
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text("x = 1\n")
    with SessionStore(home) as store:
        _, result = run(turns + [FINISH], store, ws)
        assert result.status == "finished", result.error
        for c in store.tool_calls(result.session_id):
            assert c["ok"] is not None and c["result"]
