"""Rewards from sentiment: what a rating covers, which rating wins, and the implicit signals
derived from how a session went (real store, real agent runs with a scripted policy)."""

import json

import pytest

from agent_runtime import names
from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.tools.base import ToolError
from agent_runtime.tools.registry import default_tools
from learner.sentiment import (DISSATISFIED, INVALID_CALL_REWARD, SignalConfig, derive_signals,
                               rated_sample_ids, sample_rewards)


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


EDIT = call("edit_file", path="calc.py", old="a - b", new="a + b")
TEST = call("run_command", command="python -m pytest -q")
FINISH = call("finish", summary="fixed")


def session(store, n_calls=2):
    """A finished user session with `n_calls` model calls; (session id, [(message, sample)])."""
    sid = store.create_session("t", "ws", "m", 1)
    out = []
    for i in range(n_calls):
        mid = store.add_message(sid, 0, "assistant", f"turn {i}")
        out.append((mid, store.add_sample(sid, 0, mid, [1, 2], [3, 4], [-1.0, -1.0], None, 1)))
        store.add_message(sid, 0, "tool", "ok", name="read_file")
    store.set_status(sid, "finished")
    return sid, out


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (ws / "test_calc.py").write_text("from calc import add\n\ndef test_add():\n"
                                     "    assert add(2, 3) == 5\n")
    return ws


def run(store, workspace, script, **config):
    agent = Agent(ReplayPolicy(script), store=store, workspace=workspace,
                  config=AgentConfig(**{"max_steps": 5, **config}))
    return agent.run("fix add")


def test_a_session_rating_covers_every_sample_of_the_session(store):
    sid, turns = session(store)
    store.add_feedback(1, session_id=sid)
    assert sample_rewards(store, [s for _, s in turns]) == {turns[0][1]: 1.0, turns[1][1]: 1.0}


def test_a_message_rating_covers_only_that_message_sample(store):
    sid, turns = session(store)
    store.add_feedback(-1, session_id=sid, message_id=turns[1][0])
    assert rated_sample_ids(store) == [turns[1][1]]


def test_a_signal_on_a_tool_result_covers_the_call_that_made_it(store):
    sid, turns = session(store)
    tool_message = store.messages(sid)[1]["id"]                  # the result of turn 0
    store.add_feedback(-1, session_id=sid, message_id=tool_message, source="linter_failed")
    assert sample_rewards(store, [s for _, s in turns]) == {turns[0][1]: -0.5}


def test_a_message_rating_beats_the_session_rating(store):
    sid, turns = session(store)
    store.add_feedback(-1, session_id=sid, message_id=turns[0][0])
    store.add_feedback(1, session_id=sid)
    assert sample_rewards(store, [s for _, s in turns])[turns[0][1]] == -1.0


def test_an_explicit_rating_overrides_implicit_signals(store):
    sid, turns = session(store, 1)
    store.add_feedback(1, session_id=sid, source=names.TESTS_GREEN)
    store.add_feedback(-1, session_id=sid)
    assert sample_rewards(store, [turns[0][1]]) == {turns[0][1]: -1.0}


def test_implicit_signals_add_up_by_their_weights(store):
    sid, turns = session(store, 1)
    store.add_feedback(1, session_id=sid, source=names.TESTS_GREEN)
    store.add_feedback(-1, session_id=sid, source=names.RUN_CANCELLED)
    assert sample_rewards(store, [turns[0][1]]) == {turns[0][1]: 0.25}


def test_eval_and_rollout_sessions_are_never_rated_samples(store):
    for origin in (names.ORIGIN_EVAL, names.ORIGIN_ROLLOUT):
        sid = store.create_session("t", "ws", "m", origin=origin)
        mid = store.add_message(sid, 0, "assistant", "x")
        store.add_sample(sid, 0, mid, [1], [2], [-1.0], None, 0)
        store.add_feedback(1, session_id=sid)
    assert rated_sample_ids(store) == []


def test_an_excluded_session_is_never_a_rated_sample(store):
    sid, _ = session(store)
    store.set_learn(sid, False)
    store.add_feedback(1, session_id=sid)
    assert rated_sample_ids(store) == []


def test_a_workspace_excluded_in_config_toml_is_skipped_even_for_old_sessions(store, tmp_path):
    sid, _ = session(store)
    store.add_feedback(1, session_id=sid)
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    store.db.execute("UPDATE sessions SET workspace = ? WHERE id = ?", [str(ws), sid])
    (store.home / "config.toml").write_text(f'[learning]\nexclude = ["{ws}"]\n')
    assert rated_sample_ids(store) == []


@pytest.mark.parametrize("text,dissatisfied", [
    ("that's wrong, the function should add", True), ("Undo that please", True),
    ("this broke the tests, revert it", True), ("not what I asked for", True),
    ("great, now also add multiply", False), ("thanks! can you write a test", False),
    ("find what is wrong in calc.py", False)])
def test_dissatisfied_follow_ups_are_recognised_by_rules(text, dissatisfied):
    assert bool(DISSATISFIED.search(text)) == dissatisfied


def sources(store):
    return sorted(f["source"] for f in store.feedback())


def test_a_green_last_test_run_is_a_positive_signal(store, workspace):
    run(store, workspace, [EDIT, TEST, FINISH])
    derive_signals(store)
    assert names.TESTS_GREEN in sources(store)


def test_a_run_that_uses_its_step_budget_without_finishing_is_a_negative_signal(
        store, workspace):
    read = call("read_file", path="calc.py")
    ran_out = run(store, workspace, [read, read, read], max_steps=2)
    finished = run(store, workspace, [read, FINISH], max_steps=2)
    derive_signals(store)
    rows = {(f["session_id"], f["source"]): f["rating"] for f in store.feedback()}
    assert rows[(ran_out.session_id, names.RAN_OUT)] == -1
    assert (finished.session_id, names.RAN_OUT) not in rows
    sample = store.samples(ran_out.session_id)[0]["id"]
    assert sample_rewards(store, [sample]) == {sample: -0.25}


def test_a_call_repeating_an_earlier_one_with_the_same_result_is_a_negative_signal(
        store, workspace):
    """The twelfth online bench run's hack: the same passing test run again and again. The
    first test run after the edit is new (its result differs from the run before it), the
    second is a repeat (durations aside), and its -1 x 1.0 outweighs the session's green
    tests (+0.5): the repeat's reward is -0.5, the run before the edit's +0.5, the first
    run after it +1 (it showed the failing tests fixed: `check_fixed`)."""
    result = run(store, workspace, [TEST, EDIT, TEST, TEST, FINISH])
    derive_signals(store)
    rows = [f for f in store.feedback() if f["source"] == names.REPEATED_CALL]
    assert len(rows) == 1 and rows[0]["rating"] == -1 and rows[0]["comment"] == "run_command"
    samples = {s["message_id"]: s["id"] for s in store.samples(result.session_id)}
    messages = [m["id"] for m in store.messages(result.session_id) if m["role"] == "assistant"]
    assert rows[0]["message_id"] == messages[3]
    rewards = sample_rewards(store, [samples[m] for m in messages])
    assert rewards[samples[messages[3]]] == -0.5
    assert rewards[samples[messages[0]]] == 0.5 and rewards[samples[messages[2]]] == 1.0


def test_the_same_call_with_a_new_result_is_not_a_repeat(store, workspace):
    read = call("read_file", path="calc.py")
    run(store, workspace, [read, EDIT, read, FINISH])
    derive_signals(store)
    assert names.REPEATED_CALL not in sources(store)


def test_a_finish_while_a_check_is_still_failing_is_a_negative_signal(store, workspace):
    """The hack of the twelfth to fourteenth online bench runs: the failing check run, then
    another command that passes instead of it, then `finish`. The -1 on the finish stands
    whatever covers the whole session."""
    repro = call("run_command", command="python -c 'from calc import add; assert add(2, 3) == 5'")
    other = call("run_command", command="python -c 'import calc'")
    result = run(store, workspace, [repro, other, FINISH])
    derive_signals(store)
    rows = [f for f in store.feedback() if f["source"] == names.FINISHED_FAILING]
    messages = [m["id"] for m in store.messages(result.session_id) if m["role"] == "assistant"]
    assert [(f["rating"], f["message_id"]) for f in rows] == [(-1, messages[2])]
    assert "exited 1" in rows[0]["comment"]
    samples = {s["message_id"]: s["id"] for s in store.samples(result.session_id)}
    assert sample_rewards(store, [samples[messages[2]]]) == {samples[messages[2]]: -1.0}


def test_a_finish_after_the_failing_check_passed_again_is_not_flagged(store, workspace):
    repro = call("run_command", command="python -c 'from calc import add; assert add(2, 3) == 5'")
    look = call("run_command", command="ls missing-dir")          # looking, not a check
    run(store, workspace, [repro, look, EDIT, repro, FINISH])
    derive_signals(store)
    assert names.FINISHED_FAILING not in sources(store)


REPRO = call("run_command", command="python -c 'from calc import add; assert add(2, 3) == 5'")


def test_the_edits_that_turned_a_failing_check_green_and_the_run_that_showed_it_are_credited(
        store, workspace):
    """The fifteenth online bench run's lost tasks: the task's own check ran once, failed,
    and was never run again (`pytest`, rated, ran instead). The fix and the rerun of the
    check that shows it are credited, each on its own message; the misstep before the fix
    (it left the check failing) and the test run after it are not."""
    misstep = call("edit_file", path="calc.py", old="a - b", new="a * b")
    fix = call("edit_file", path="calc.py", old="a * b", new="a + b")
    result = run(store, workspace, [REPRO, misstep, REPRO, fix, REPRO, TEST, FINISH],
                 max_steps=8)
    derive_signals(store)
    messages = [m["id"] for m in store.messages(result.session_id) if m["role"] == "assistant"]
    rows = [f for f in store.feedback() if f["source"] == names.CHECK_FIXED]
    assert sorted((f["rating"], f["message_id"]) for f in rows) == [(1, messages[3]),
                                                                    (1, messages[4])]
    assert rows[0]["comment"].endswith("exited 0")
    samples = {s["message_id"]: s["id"] for s in store.samples(result.session_id)}
    rewards = sample_rewards(store, [samples[m] for m in messages])
    assert rewards[samples[messages[3]]] == rewards[samples[messages[4]]] == 1.0
    assert rewards[samples[messages[1]]] == rewards[samples[messages[5]]] == 0.5  # tests_green


def test_repairing_a_check_the_agent_broke_itself_is_not_credited(store, workspace):
    fix = call("edit_file", path="calc.py", old="a - b", new="a + b")
    breaks = call("edit_file", path="calc.py", old="a + b", new="a * b")
    repairs = call("edit_file", path="calc.py", old="a * b", new="a + b")
    run(store, workspace, [fix, breaks, REPRO, repairs, REPRO, FINISH], max_steps=7)
    derive_signals(store)
    assert names.CHECK_FIXED not in sources(store)


def test_a_check_fixed_once_earns_nothing_for_being_broken_and_fixed_again(store, workspace):
    fix = call("edit_file", path="calc.py", old="a - b", new="a + b")
    breaks = call("edit_file", path="calc.py", old="a + b", new="a * b")
    repairs = call("edit_file", path="calc.py", old="a * b", new="a + b")
    result = run(store, workspace, [REPRO, fix, REPRO, breaks, REPRO, repairs, REPRO, FINISH],
                 max_steps=9)
    derive_signals(store)
    messages = [m["id"] for m in store.messages(result.session_id) if m["role"] == "assistant"]
    assert sorted(f["message_id"] for f in store.feedback()
                  if f["source"] == names.CHECK_FIXED) == [messages[1], messages[2]]


def test_a_dissatisfied_follow_up_rates_the_turn_before_it(store, workspace):
    result = run(store, workspace, [EDIT, FINISH])
    agent = Agent(ReplayPolicy([FINISH]), store=store, workspace=workspace)
    agent.resume(result.session_id, message="that's wrong, undo it")
    derive_signals(store)
    [row] = [f for f in store.feedback() if f["source"] == names.FOLLOWUP_DISSATISFIED]
    assert row["rating"] == -1 and row["message_id"] is not None


def test_a_declined_call_is_a_negative_signal_on_that_turn(store, workspace):
    class Declining:
        name, description, mutates = "edit_file", "edit", True
        parameters = next(t for t in default_tools() if t.name == "edit_file").parameters

        def __call__(self, args, ctx):
            raise ToolError(f"{names.DECLINED_PREFIX} this edit_file call.")

    tools = [Declining() if t.name == "edit_file" else t for t in default_tools()]
    Agent(ReplayPolicy([EDIT, FINISH]), tools=tools, store=store, workspace=workspace,
          config=AgentConfig(max_steps=5)).run("fix add")
    derive_signals(store)
    assert names.PERMISSION_REJECTED in sources(store)


def test_a_declined_call_an_editor_already_recorded_counts_once(store, workspace):
    class Declining:
        name, description, mutates = "edit_file", "edit", True
        parameters = next(t for t in default_tools() if t.name == "edit_file").parameters

        def __call__(self, args, ctx):
            raise ToolError(f"{names.DECLINED_PREFIX} this edit_file call.")

    tools = [Declining() if t.name == "edit_file" else t for t in default_tools()]
    result = Agent(ReplayPolicy([EDIT, FINISH]), tools=tools, store=store, workspace=workspace,
                   config=AgentConfig(max_steps=5)).run("fix add")
    asked = store.tool_calls(result.session_id)[0]["message_id"]
    store.add_feedback(-1, session_id=result.session_id, message_id=asked,
                       source=names.PERMISSION_REJECTED)            # as the ACP agent does
    derive_signals(store)
    assert sources(store).count(names.PERMISSION_REJECTED) == 1


def test_a_plugin_s_source_counts_at_the_plugin_weight(store):
    sid, turns = session(store, 1)
    store.add_feedback(-1, session_id=sid, source="linter_failed")
    assert sample_rewards(store, [turns[0][1]]) == {turns[0][1]: -0.5}


def test_edits_still_in_place_at_the_next_session_are_kept(store, workspace):
    run(store, workspace, [EDIT, FINISH])
    run(store, workspace, [FINISH])                       # the next session in the workspace
    derive_signals(store)
    assert sources(store).count(names.EDIT_KEPT) == 1


def test_edits_the_user_put_back_are_reverted(store, workspace):
    before = (workspace / "calc.py").read_text()
    run(store, workspace, [EDIT, FINISH])
    (workspace / "calc.py").write_text(before)
    derive_signals(store, SignalConfig(edit_delay_s=0))
    assert names.EDIT_REVERTED in sources(store)


def test_edits_wait_to_be_judged_until_a_later_session_or_the_delay(store, workspace):
    run(store, workspace, [EDIT, FINISH])
    assert derive_signals(store) == 0 and names.EDIT_KEPT not in sources(store)


def test_signals_are_derived_once(store, workspace):
    run(store, workspace, [EDIT, TEST, FINISH])
    derive_signals(store, SignalConfig(edit_delay_s=0))
    assert derive_signals(store, SignalConfig(edit_delay_s=0)) == 0


def test_a_malformed_call_is_not_rewarded_by_a_session_thumbs_up(store, workspace):
    broken = "<tool_call>\n{\"name\": \"edit_file\", \"arguments\": {\n</tool_call>"
    sid = run(store, workspace, [broken, EDIT, FINISH]).session_id
    calls = [m["id"] for m in store.messages(sid) if m["role"] == "assistant"]
    sample = {s["message_id"]: s["id"] for s in store.samples(sid)}
    assert len(calls) == 3 and set(sample) == set(calls)
    store.add_feedback(1, session_id=sid)
    rewards = sample_rewards(store, list(sample.values()))
    assert rewards == {sample[calls[0]]: INVALID_CALL_REWARD, sample[calls[1]]: 1.0,
                       sample[calls[2]]: 1.0}
    store.add_feedback(1, session_id=sid, message_id=calls[0])    # the user liked that very call
    assert sample_rewards(store, [sample[calls[0]]]) == {sample[calls[0]]: 1.0}
