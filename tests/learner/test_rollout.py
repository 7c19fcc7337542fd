"""Rollouts: real agent runs in fresh workspaces, graded, recorded in the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store.migrations import MIGRATIONS
from learner.rollout import Episode, rewards, run_episode, run_episodes
from learner.tasks import generate
from learner.tasks.oracle import OraclePolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tasks():
    return generate("train", 6, seed=31)


def test_an_episode_is_a_recorded_session_with_samples_and_a_reward(store, tasks):
    task = tasks[0]
    episode = run_episode(OraclePolicy(task), task, store)
    assert isinstance(episode, Episode)
    assert (episode.task_id, episode.family, episode.split) == (task.id, task.family, "train")
    assert episode.reward == 1.0 and episode.passed and episode.status == "finished"
    session = store.get_session(episode.session_id)
    assert session["task"] == task.instruction and session["status"] == "finished"
    samples = store.samples(episode.session_id)
    assert len(samples) == episode.steps >= 3
    assert episode.tokens == sum(len(s["completion_ids"]) for s in samples) > 0
    assert all(len(s["logprobs"]) == len(s["completion_ids"]) and s["prompt_ids"]
               for s in samples)
    assert all(s["policy_version"] == 0 for s in samples)
    (row,) = rewards(store, episode.session_id)
    assert (row["task_id"], row["reward"], row["passed"], row["cheated"]) == \
        (task.id, 1.0, True, False)
    assert row["meta"]["difficulty"] == task.difficulty


def test_the_rewards_table_comes_from_a_numbered_migration():
    assert "m002_rewards" in [fn.__name__ for fn in MIGRATIONS]


def test_a_policy_that_does_nothing_scores_0_without_being_flagged(store, tasks):
    task = tasks[1]
    episode = run_episode(ReplayPolicy([call("finish", summary="nothing to do")]), task, store)
    assert episode.status == "finished" and episode.steps == 1
    assert episode.reward == 0.0 and not episode.passed and not episode.cheated
    assert episode.detail.startswith("tests failed")


def test_running_out_of_steps_is_graded_too(store, tasks):
    task = tasks[2]
    loop = [call("list_files")] * 5
    episode = run_episode(ReplayPolicy(loop), task, store, max_steps=3)
    assert episode.status == "budget_exhausted" and episode.steps == 3
    assert episode.reward == 0.0
    assert len(rewards(store, episode.session_id)) == 1


def test_a_failing_policy_is_recorded_as_failed(store, tasks):
    episode = run_episode(ReplayPolicy([]), tasks[3], store)   # raises on its first call
    assert episode.status == "failed" and episode.reward == 0.0


def test_the_workspace_is_fresh_removed_and_never_holds_hidden_tests(store, tasks, tmp_path):
    task = tasks[4]
    seen = {}

    class Spy(OraclePolicy):
        def complete(self, messages, tools=None, **kw):
            workspace = Path(store.get_session(store.list_sessions(1, include_all=True)[0]["id"])["workspace"])
            seen.setdefault("files", {p.relative_to(workspace).as_posix()
                                      for p in workspace.rglob("*") if p.is_file()})
            return super().complete(messages, tools, **kw)

    work = tmp_path / "work"
    work.mkdir()
    episode = run_episode(Spy(task), task, store, workdir=work)
    assert episode.reward == 1.0
    assert seen["files"] == set(task.files)
    assert not any(work.iterdir())                           # removed afterwards
    kept = run_episode(OraclePolicy(task), task, store, workdir=work, keep_workspace=True)
    assert Path(kept.workspace).is_dir()
    assert not set(task.hidden_tests) & {p.relative_to(kept.workspace).as_posix()
                                         for p in Path(kept.workspace).rglob("*")}


def test_episodes_run_concurrently_in_isolated_workspaces_and_keep_their_order(store, tasks):
    finished = []                       # what a progress display sees, as episodes finish
    episodes = run_episodes(OraclePolicy, tasks, store, concurrency=3, on_episode=finished.append)
    assert [e.task_id for e in episodes] == [t.id for t in tasks]
    assert sorted(e.session_id for e in finished) == sorted(e.session_id for e in episodes)
    assert len({e.session_id for e in episodes}) == len(tasks)
    assert all(e.reward == 1.0 for e in episodes), [e.detail for e in episodes]
    assert len(rewards(store)) == len(tasks)


def test_unsandboxed_rollouts_work_too(store, tasks):
    episode = run_episode(OraclePolicy(tasks[5]), tasks[5], store, sandbox="off")
    assert episode.reward == 1.0
    calls = store.tool_calls(episode.session_id)
    assert any(c["name"] == "run_command" and c["data"]["sandboxed"] is False for c in calls)


def test_commands_run_with_the_tasks_environment_and_this_python(store, tasks):
    import sys
    task = tasks[0]
    script = [call("run_command", command="python -c 'import sys; print(sys.executable)'; "
                   "echo plugins=$PYTEST_DISABLE_PLUGIN_AUTOLOAD"),
              call("finish", summary="looked")]
    episode = run_episode(ReplayPolicy(script), task, store)
    out = store.tool_calls(episode.session_id)[0]["result"]
    assert str(Path(sys.executable).parent) in out and "plugins=1" in out


def test_a_failure_that_breaks_less_earns_more_partial_credit_and_cheats_none(store, tasks):
    """With `partial_credit`, a failed honest episode's training reward is that weight times
    the share of the tests it left passing (pytest's summary, recorded with the reward):
    doing nothing keeps the passing tests, breaking the package's `__init__` fails them
    all; a pass stays 1 and a cheat 0."""
    from learner.pipeline import shaped_reward
    task = tasks[1]
    package = next(p for p in task.files if p.endswith("/__init__.py"))
    idle = run_episode(ReplayPolicy([call("finish", summary="nothing to do")]), task, store)
    broke = run_episode(ReplayPolicy([call("write_file", path=package, content="def (:\n"),
                                      call("finish", summary="done")]), task, store)
    cheat = run_episode(ReplayPolicy([call("write_file", path="tests/test_grading.py",
                                           content="def test_ok():\n    assert True\n"),
                                      call("finish", summary="done")]), task, store)
    solved = run_episode(OraclePolicy(task), task, store)
    assert not idle.passed and not broke.passed and cheat.cheated and solved.passed
    (row,) = rewards(store, idle.session_id)
    passed, run = row["meta"]["tests"]
    assert 0 < passed < run and idle.tests_share == passed / run
    assert broke.tests_share == 0.0
    assert [shaped_reward(e, 0.0) for e in (idle, broke, cheat, solved)] == [0.0, 0.0, 0.0, 1.0]
    assert [shaped_reward(e, 0.5) for e in (idle, broke, cheat, solved)] == \
        [0.5 * passed / run, 0.0, 0.0, 1.0]


def test_an_episode_can_end_at_its_first_failed_check_after_a_change(store, tasks):
    """`stop_after_failed_checks`: a check (a command that runs code) failing after the
    episode changed a file ends it (status "cancelled", graded as left); one failing before
    any change does not count, nor does a search that finds nothing, and without the limit
    the episode plays on."""
    task = tasks[2]
    fail = call("run_command", command="python -c 'import sys; sys.exit(3)'")
    script = [fail, call("write_file", path="notes.txt", content="looked\n"),
              call("run_command", command="grep -rq no_such_name ."),
              fail, call("list_files"), call("finish", summary="done")]
    cut = run_episode(ReplayPolicy(script), task, store, stop_after_failed_checks=1)
    assert cut.status == "cancelled" and cut.steps == 4
    assert [c["name"] for c in store.tool_calls(cut.session_id)] == \
        ["run_command", "write_file", "run_command", "run_command"]
    assert store.tool_calls(cut.session_id)[2]["data"]["exit_code"] == 1
    assert len(rewards(store, cut.session_id)) == 1 and not cut.passed
    whole = run_episode(ReplayPolicy(script), task, store)
    assert whole.status == "finished" and whole.steps == 6
    twice = run_episode(ReplayPolicy(script), task, store, stop_after_failed_checks=2)
    assert twice.status == "finished" and twice.steps == 6


class Remembering(ReplayPolicy):
    """A replay policy that, like `EnginePolicy`, is told which message each call became."""

    def __init__(self, script):
        super().__init__(script)
        self.remembered = []

    def remember(self, message, completion):
        self.remembered.append(completion.text)


def test_an_oracle_start_plays_the_plans_first_turns_and_trains_only_the_policys_calls(store,
                                                                                      tasks):
    """`OracleStart(task, policy, k)`: the oracle's first k turns, then the policy's. Their
    samples are empty (nothing of the oracle's trains), the policy's carry its ids, and the
    policy is told only of its own calls. The outcome is the policy's: the plan's remaining
    turns pass, a bare `finish` after the same start fails."""
    from learner.tasks.oracle import OracleStart, script
    task = tasks[0]
    plan = script(task)
    k = len(plan) - 3
    rest = Remembering(plan[k:])
    solved = run_episode(OracleStart(task, rest, k), task, store)
    assert solved.passed and solved.steps == len(plan)
    samples = store.samples(solved.session_id)
    assert [bool(s["completion_ids"]) for s in samples] == [False] * k + [True] * (len(plan) - k)
    assert solved.tokens == sum(len(s["completion_ids"]) for s in samples) > 0
    assert rest.remembered == plan[k:]
    quit_early = run_episode(OracleStart(task, ReplayPolicy([call("finish", summary="done")]), k),
                             task, store)
    assert quit_early.steps == k + 1 and not quit_early.passed


def test_a_slip_start_ends_on_a_search_that_finds_nothing_and_the_policy_plays_the_recovery(
        store):
    """`slip_start` on a rename: the oracle's turns up to its first search played for a name
    the code does not have (the rename's new name, or a typo of the old one), so the tool
    answers "no matches"; the policy plays from there. The plan's own recovery passes, a bare
    `finish` fails, and only the policy's calls carry token ids. Share 0 draws no start."""
    import random
    from agent_runtime.toolcalls import parse_tool_calls
    from learner.tasks.oracle import OracleStart, slip_start
    task = generate("train", 1, seed=31, families=["rename_symbol"])[0]
    assert slip_start(task, 0.0, random.Random(0)) == (None, 0)
    plan, k = slip_start(task, 1.0, random.Random(0))
    (slip,) = parse_tool_calls(plan[k - 1]).calls
    assert slip.name == "grep"
    assert not any(slip.arguments["pattern"] in text for text in task.files.values())
    recovered = run_episode(OracleStart(task, ReplayPolicy(plan[k:]), k, plan), task, store)
    assert recovered.passed and recovered.steps == len(plan)
    messages = store.messages(recovered.session_id)
    assert any(m["role"] == "tool" and "no matches" in (m["content"] or "") for m in messages)
    samples = store.samples(recovered.session_id)
    assert [bool(s["completion_ids"]) for s in samples] == [False] * k + [True] * (len(plan) - k)
    gave_up = run_episode(OracleStart(task, ReplayPolicy([call("finish", summary="done")]), k,
                                      plan), task, store)
    assert gave_up.steps == k + 1 and not gave_up.passed


def test_where_groups_start_is_drawn_inside_the_plan():
    """`start_turns`: 0 with share 0; with share 1 every draw in 1 .. n - 3 (the policy keeps
    the plan's change, its check and finish) and each of them drawn."""
    import random
    from learner.tasks.oracle import script, start_turns
    task = next(t for t in generate("train", 12, seed=31) if len(script(t)) >= 5)
    n, rng = len(script(task)), random.Random(0)
    assert {start_turns(task, 0.0, rng) for _ in range(50)} == {0}
    assert {start_turns(task, 1.0, rng) for _ in range(400)} == set(range(1, n - 2))
    half = [start_turns(task, 0.5, rng) for _ in range(400)]
    assert 120 < half.count(0) < 280


def test_a_sim_group_with_oracle_starts_records_where_it_began(store, tasks):
    """`RolloutConfig.oracle_start` 1: every episode of the group starts after the same
    number of oracle turns, recorded on the group; the samples GRPO would train on are the
    policy's calls only."""
    from learner.config import LossConfig, RolloutConfig
    from learner.grpo import group_samples
    from learner.pipeline import run_sim_group
    from learner.tasks.oracle import script
    task = tasks[3]
    policy = ReplayPolicy([call("finish", summary="done")] * 4)
    group = run_sim_group(policy, task, store, RolloutConfig(group_size=2, concurrency=1,
                                                             oracle_start=1.0))
    assert 1 <= group.start <= len(script(task)) - 3
    for samples in group.samples:
        assert [bool(s["completion_ids"]) for s in samples] == [False] * group.start + [True]
    group.episodes[0].reward = 1.0               # as if one of them had passed
    trained = group_samples(group, LossConfig())
    assert len(trained) == 2 and all(s.n_tokens for s in trained)


@pytest.mark.parametrize("check", [True, False])
def test_a_sim_groups_calls_are_held_to_the_workspace_unless_turned_off(store, tasks, check):
    """`RolloutConfig.check_references` (on by default): each rollout's call grammar sees the
    episode's workspace (`AgentConfig.check_references`), where serving holds calls to their
    form only."""
    from agent_runtime.callgrammar import WorkspaceView
    from learner.config import RolloutConfig
    from learner.pipeline import run_sim_group
    from fake_policies import GrammarTaker
    assert RolloutConfig().check_references
    policy = GrammarTaker()
    group = run_sim_group(policy, tasks[0], store, RolloutConfig(group_size=2, concurrency=1,
                                                                 check_references=check))
    assert len(group.episodes) == 2 and len(policy.grammars) == 2
    views = [g.view for g in policy.grammars]
    assert all(isinstance(v, WorkspaceView) for v in views) if check else views == [None, None]
