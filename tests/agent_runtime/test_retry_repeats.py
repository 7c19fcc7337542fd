"""AgentConfig.retry_repeats: a turn whose every tool call was made already, with nothing
changed since, is handed back to the policy to sample again (real agent loop, real tools, a
scripted policy that keeps the engine's contract: `retry_if` rejects a text, the next one is
tried)."""

import json

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.policies.base import Completion
from agent_runtime.store import SessionStore


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


READ = call("read_file", path="calc.py")
GREP = call("grep", pattern="add")
EDIT = call("edit_file", path="calc.py", old="a - b", new="a + b")
TEST = call("run_command", command="python -c 'print(1)'")
OTHER = call("run_command", command="python -c 'print(2)'")
FINISH = call("finish", summary="done")


class Retrying:
    """Each turn is a list of texts: the first is proposed, and while the agent's `retry_if`
    rejects it, the next (as the engine samples again, hotter); the last is kept."""

    accepts_retry = True
    name, version, context_window = "scripted", 0, 100_000

    def __init__(self, turns):
        self.turns, self.rejected = list(turns), []

    def count_tokens(self, messages, tools=None):
        return 0

    def complete(self, messages, tools=None, *, max_new_tokens=None, on_text=None,
                 should_stop=None, retry_if=None):
        options = self.turns.pop(0)
        for text in options[:-1]:
            if retry_if is None or not retry_if(text):
                break
            self.rejected.append(text)
        else:
            text = options[-1]
        return Completion(text=text, prompt_ids=[1], completion_ids=[2], logprobs=[-1.0])


def run(tmp_path, turns, **config):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    policy = Retrying(turns)
    store = SessionStore(tmp_path / "home")
    result = Agent(policy, store=store, workspace=ws, sandbox=False,
                   config=AgentConfig(max_steps=len(turns), **config)).run("fix add")
    calls = [c["name"] for c in store.tool_calls(result.session_id)]
    return policy.rejected, calls


def test_a_read_made_already_is_sampled_again(tmp_path):
    rejected, calls = run(tmp_path, [[READ], [READ, GREP], [FINISH]])
    assert rejected == [READ] and calls == ["read_file", "grep", "finish"]


def test_an_edit_in_between_makes_the_same_read_new(tmp_path):
    rejected, calls = run(tmp_path, [[READ], [EDIT], [READ, GREP], [FINISH]])
    assert rejected == [] and calls == ["read_file", "edit_file", "read_file", "finish"]


def test_the_same_command_again_is_a_repeat_unless_another_ran_in_between(tmp_path):
    rejected, _ = run(tmp_path, [[TEST], [TEST, GREP], [FINISH]])
    assert rejected == [TEST]
    rejected, _ = run(tmp_path, [[TEST], [OTHER], [TEST, GREP], [FINISH]])
    assert rejected == []


def test_finish_and_turns_with_a_new_call_are_never_sampled_again(tmp_path):
    rejected, _ = run(tmp_path, [[READ], [READ + "\n" + GREP, FINISH], [FINISH]])
    assert rejected == []


def test_when_every_attempt_repeats_the_last_one_runs(tmp_path):
    rejected, calls = run(tmp_path, [[READ], [READ, READ], [FINISH]])
    assert rejected == [READ] and calls == ["read_file", "read_file", "finish"]


def test_retry_repeats_off_keeps_the_repeat(tmp_path):
    rejected, calls = run(tmp_path, [[READ], [READ, GREP], [FINISH]], retry_repeats=False)
    assert rejected == [] and calls == ["read_file", "read_file", "finish"]
