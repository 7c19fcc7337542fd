"""The self-summarizing context: budgets in the policy's tokens, segments with summaries."""

import json

import pytest

from agent_runtime.agent import Agent, AgentConfig, Callbacks
from agent_runtime.context import SUMMARY_REQUEST, Context, ContextConfig
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.tools.base import tool_schema
from agent_runtime.tools.registry import default_tools

TASK = "Count the lines of big.txt, reading it in parts."


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "big.txt").write_text("".join(f"line {i:04d} of a long and boring file\n"
                                        for i in range(400)))
    return ws


def head_tokens(policy, config=None) -> int:
    """Tokens of system prompt + task + tool descriptions: the floor of every prompt."""
    config = config or AgentConfig()
    schemas = [tool_schema(t) for t in default_tools()]
    return policy.count_tokens(Context(config.system_prompt, TASK).messages, schemas)


def test_a_small_window_run_finishes_across_at_least_three_segments(store, workspace):
    reads = [call("read_file", path="big.txt", offset=1 + 30 * i, limit=30) for i in range(10)]
    summaries = [{"summary": f"## Goal\nCount lines.\n## Done so far\nRead part {i}."}
                 for i in range(10)]
    policy = ReplayPolicy(reads + summaries + [call("finish", summary="400 lines")])
    policy.context_window = head_tokens(policy) + 4000   # about three reads: far below the task's need
    seen = []
    agent = Agent(policy, default_tools(), store, workspace,
                  config=AgentConfig(summary_max_tokens=300),
                  callbacks=Callbacks(on_summarize=lambda seg, s: seen.append((seg, s))))
    result = agent.run(TASK)
    assert result.status == "finished", result.summary
    segments = store.segments(result.session_id)
    assert len(segments) >= 3 and segments[0]["summary"] is None
    assert [s["summary"] for s in segments[1:]] == [s["summary"] for s in summaries[:len(segments) - 1]]
    assert seen == [(s["idx"], s["summary"]) for s in segments[1:]]      # the user saw each one
    assert all(s["segment"] in {g["idx"] for g in segments} for s in store.samples(result.session_id))
    assert max(len(s["prompt_ids"]) for s in store.samples(result.session_id)) < policy.context_window


def test_a_restart_keeps_system_prompt_task_summary_and_the_latest_user_message():
    context = Context("sys", TASK)
    for message in [{"role": "user", "content": "also fix the docs", "kind": "user"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "tool", "content": "result", "name": "read_file"}]:
        context.append(message)
    context.restart("## Goal\nfix")
    roles = [(m["role"], m.get("kind")) for m in context.messages]
    assert roles == [("system", None), ("user", "task"), ("user", "summary"), ("user", "user")]
    assert context.messages[2]["content"].endswith("## Goal\nfix") and context.segment == 1
    assert context.messages[3]["content"] == "also fix the docs"


def test_the_summary_request_elides_the_oldest_turns_until_it_fits():
    policy = ReplayPolicy([])
    context = Context("sys", TASK, config=ContextConfig(summary_max_tokens=500))
    policy.context_window = policy.count_tokens(context.messages) + 3000     # 6 turns need ~5000
    for i in range(6):
        context.append({"role": "tool", "content": f"turn {i} " + "x" * 800, "name": "read_file"})
    request = context.summary_request(policy)
    assert policy.count_tokens(request) <= policy.context_window - 500
    assert request[-1]["kind"] == SUMMARY_REQUEST
    assert "elided" in request[2]["content"] and request[-2]["content"].startswith("turn 5")


def test_threshold_and_instruction_are_configurable(store, workspace):
    reads = [call("read_file", path="big.txt", limit=30)] * 3
    policy = ReplayPolicy(reads + [call("finish", summary="done")])
    policy.context_window = head_tokens(policy) + 20000
    config = AgentConfig(summarize_at=0.01, summary_instruction="SUMMARIZE PLEASE")
    result = Agent(policy, default_tools(), store, workspace, config=config).run(TASK)
    asks = [m for m in store.messages(result.session_id)
            if (m["meta"] or {}).get("kind") == SUMMARY_REQUEST]
    assert asks and all(m["content"] == "SUMMARIZE PLEASE" for m in asks)


def test_without_summaries_in_the_script_a_generic_summary_keeps_the_run_going(store, workspace):
    reads = [call("read_file", path="big.txt", offset=1 + 30 * i, limit=30) for i in range(6)]
    policy = ReplayPolicy(reads + [call("finish", summary="done")])
    policy.context_window = head_tokens(policy) + 4000
    result = Agent(policy, default_tools(), store, workspace,
                   config=AgentConfig(summary_max_tokens=300)).run(TASK)
    assert result.status == "finished"
    assert TASK in store.segments(result.session_id)[1]["summary"]


def test_a_tool_result_bigger_than_the_window_is_summarized_away(store, workspace):
    policy = ReplayPolicy([call("read_file", path="big.txt"), call("finish", summary="done")])
    policy.context_window = head_tokens(policy) + 3000                # big.txt alone is ~17k
    result = Agent(policy, default_tools(), store, workspace,
                   config=AgentConfig(summary_max_tokens=300)).run(TASK)
    assert result.status == "finished" and len(store.segments(result.session_id)) == 2


def test_resume_rebuilds_the_latest_segment_from_its_summary(store, workspace):
    reads = [call("read_file", path="big.txt", offset=1 + 30 * i, limit=30) for i in range(6)]
    policy = ReplayPolicy(reads + [{"summary": "S1"}, {"summary": "S2"}, {"summary": "S3"}])
    policy.context_window = head_tokens(policy) + 4000
    config = AgentConfig(summary_max_tokens=300)
    first = Agent(policy, default_tools(), store, workspace, config=config).run(TASK)
    assert first.status == "failed" and first.segment >= 1             # script ran out
    again = ReplayPolicy([call("finish", summary="done")], context_window=policy.context_window)
    result = Agent(again, default_tools(), store, workspace, config=config).resume(first.session_id)
    prompt = again.tokenizer.decode(store.samples(first.session_id)[-1]["prompt_ids"])
    latest = store.segments(first.session_id)[-1]["summary"]
    assert result.status == "finished" and latest in prompt and TASK in prompt
    assert "S1" not in prompt or latest == "S1"
