"""The gate: regressions beyond their margins are rejected with every reason named, and
(acceptance 3) a deliberately harmful update, thumbs up on sessions full of invalid tool
calls, is rejected: the serving version stays and `learn status` says why."""

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import INVALID, SYSTEM, VALID, record_session, teach  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner.gate import Gate, GateConfig, GateMetrics, compare  # noqa: E402
from learner.online import OnlineConfig, OnlineLearner, result_of  # noqa: E402
from learner.tasks import generate  # noqa: E402

SERVING = GateMetrics(n=10, pass_at_1=0.5, calls=40, invalid_rate=0.05, no_call_rate=0.1)


def with_(**over):
    return GateMetrics(**{**SERVING.__dict__, **over})


def test_an_equal_candidate_passes():
    assert compare(SERVING, with_(), GateConfig()).passed


def test_a_pass_rate_drop_within_the_margin_passes():
    assert compare(SERVING, with_(pass_at_1=0.45), GateConfig(pass_tasks=0,
                                                              pass_margin=0.05)).passed


def test_a_pass_rate_drop_beyond_the_margin_is_rejected_and_named():
    result = compare(SERVING, with_(pass_at_1=0.4), GateConfig(pass_tasks=0, pass_margin=0.05))
    assert not result.passed and "pass@1 0.500 -> 0.400" in result.reason


def test_one_task_less_passes_and_two_are_rejected():
    """10 tasks: 5 -> 4 solved is one task (the flip any update makes on a greedy episode
    of a code-writing task), 5 -> 3 is a regression; pass_tasks 0 allows none."""
    assert compare(SERVING, with_(pass_at_1=0.4), GateConfig()).passed
    assert not compare(SERVING, with_(pass_at_1=0.4), GateConfig(pass_tasks=0)).passed
    result = compare(SERVING, with_(pass_at_1=0.3), GateConfig())
    assert not result.passed and "pass@1 0.500 -> 0.300" in result.reason


def test_more_invalid_tool_calls_are_rejected():
    result = compare(SERVING, with_(invalid_rate=0.2), GateConfig())
    assert not result.passed and "invalid tool calls" in result.reason


def test_a_rise_within_the_noise_of_the_runs_passes():
    """~80 model calls a run: 0.077 -> 0.130 is within 1.645 pooled standard errors (0.069);
    the fixed 2-point margin alone rejects it (bench/online.py did, repeatedly)."""
    serving = with_(calls=78, invalid_rate=0.077)
    assert compare(serving, with_(calls=77, invalid_rate=0.130), GateConfig()).passed
    strict = compare(serving, with_(calls=77, invalid_rate=0.130), GateConfig(z=0))
    assert not strict.passed and "margin 0.020" in strict.reason
    result = compare(serving, with_(calls=77, invalid_rate=0.217), GateConfig())
    assert not result.passed and "invalid tool calls 0.077 -> 0.217" in result.reason


def test_with_many_calls_the_fixed_margin_decides():
    serving = with_(calls=4000, invalid_rate=0.05)
    assert compare(serving, with_(calls=4000, invalid_rate=0.065), GateConfig()).passed
    result = compare(serving, with_(calls=4000, invalid_rate=0.08), GateConfig())
    assert not result.passed and "margin 0.020" in result.reason


def test_few_calls_never_excuse_a_rise_beyond_the_cap():
    result = compare(with_(calls=4, invalid_rate=0.0), with_(calls=4, invalid_rate=0.5),
                     GateConfig())
    assert not result.passed and "margin 0.100" in result.reason


def test_more_repeated_calls_are_rejected():
    result = compare(SERVING, with_(repeat_rate=0.4), GateConfig())
    assert not result.passed and "repeated calls 0.000 -> 0.400" in result.reason


def test_asking_instead_of_acting_is_rejected():
    result = compare(SERVING, with_(no_call_rate=0.5), GateConfig())
    assert not result.passed and "without a tool call" in result.reason


class ScriptedGate(Gate):
    """The gate's bookkeeping (cache, anchor, comparison) with each state's numbers given,
    not measured by episodes (those are the tests below); counts the measurements."""

    def __init__(self, state_dir, numbers):
        super().__init__("unused", state_dir)
        self.numbers, self.measured = numbers, []

    def measure(self, state):
        self.measured.append(state["name"])
        return self.numbers[state["name"]]


def test_drift_inside_each_cycles_margin_is_caught_against_the_lines_start(tmp_path):
    """Each cycle's rise of repeated calls passes against the serving version (within the
    noise margin of its calls); against version 1 it is beyond it."""
    gate = ScriptedGate(tmp_path, {"v1": with_(repeat_rate=0.30), "v2": with_(repeat_rate=0.37),
                                   "v3": with_(repeat_rate=0.44)})
    start = ("sha-v1", lambda: {"name": "v1"})
    first = gate.check({"name": "v1"}, "sha-v1", {"name": "v2"}, "sha-v2", start)
    assert first.passed, first.reason
    second = gate.check({"name": "v2"}, "sha-v2", {"name": "v3"}, "sha-v3", start)
    assert not second.passed
    assert "since the version line's start: repeated calls 0.300 -> 0.440" in second.reason
    assert compare(with_(repeat_rate=0.37), with_(repeat_rate=0.44), GateConfig()).passed
    # every state measured once: v2's numbers as a candidate were its numbers as serving
    assert gate.measured == ["v1", "v2", "v3"]


GATE = GateConfig(n_tasks=2, max_steps=2, max_new_tokens=48, concurrency=1)


@pytest.fixture(scope="module")
def tool_user(tmp_path_factory):
    """A tiny checkpoint taught to answer the gate's held-out tasks with a valid tool call,
    so that it has tool-call validity to lose."""
    import torch
    torch.set_num_threads(1)
    ckpt = save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t.instruction}]
               for t in generate("heldout", GATE.n_tasks, seed=GATE.seed)]
    teach(ckpt, load_policy(str(ckpt), dtype="bfloat16"), prompts, VALID, steps=30, lr=5e-3)
    return ckpt


def test_thumbs_up_on_invalid_tool_calls_is_rejected_and_shown(tool_user, home, one_thread):
    policy = load_policy(str(tool_user), dtype="bfloat16")
    with SessionStore() as store:
        for task in generate("heldout", GATE.n_tasks, seed=GATE.seed):
            sid = record_session(store, policy, task.instruction, INVALID)
            store.add_feedback(1, session_id=sid)
        config = OnlineConfig(model=str(tool_user), steps=4, max_update=0.0, max_changed=1.0,
                              gate=GATE)
        config.trainer.optim.lr = 1e-2       # deliberately harmful: strong, uncapped, dense
        learner = OnlineLearner(store, config)
        result = learner.run_cycle()
        assert result.liked == GATE.n_tasks and result.version is None
        assert learner.versions.latest().version == 1
        row = result_of(store, result.cycle_id)
        assert row["status"] == "rejected" and row["reason"].startswith("regressed: ")
    out = CliRunner().invoke(main, ["learn", "status"]).output
    assert "last cycle rejected" in out and row["reason"] in out
