"""The rollout/trainer pipeline: sync and async modes, versions on every sample, bounded
staleness, overlap of rollouts with training, and worker failures."""

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.store import SessionStore  # noqa: E402
from learner import pipeline, toy  # noqa: E402
from learner.config import (OptimConfig, PipelineConfig, RolloutConfig, RunConfig,  # noqa: E402
                            TrainerConfig)
from learner.grpo import Episode, Group  # noqa: E402
from learner.versions import VersionStore  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


def config(ckpt, mode: str, steps: int = 3, processes: bool = False, workers: int = 1,
           **pipe) -> RunConfig:
    return RunConfig(model=str(ckpt), tasks="toy",
                     trainer=TrainerConfig(optim=OptimConfig(lr=1e-2)),
                     rollout=RolloutConfig(group_size=4, max_new_tokens=6, processes=processes,
                                           workers=workers),
                     pipeline=PipelineConfig(mode=mode, steps=steps, groups_per_step=2, **pipe))


def build(ckpt, tmp_path, mode, **kw):
    store = SessionStore(tmp_path / "home")
    versions = VersionStore(tmp_path / "versions")
    pipe = pipeline.build(config(ckpt, mode, **kw), tmp_path / "run", store, versions)
    return pipe, store, versions


def all_samples(store):
    return [s for row in store.list_sessions(1000, include_all=True) for s in store.samples(row["id"])]


def test_sync_mode_trains_only_on_policy(ckpt, tmp_path):
    pipe, store, versions = build(ckpt, tmp_path, "sync")
    rows = []
    pipe.run(on_step=rows.append)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 and r["stale_dropped"] == 0 for r in rows)
    samples = all_samples(store)
    assert len(samples) == 3 * 2 * 4                            # steps x groups x G
    assert sorted({s["policy_version"] for s in samples}) == [1, 2, 3]
    assert versions.latest().version == 4 == pipe.trainer.version


@pytest.mark.parametrize("processes,workers", [(False, 1), (False, 2), (True, 1)],
                         ids=["thread", "2-threads", "process"])
def test_async_mode_tags_every_sample_with_a_published_version(ckpt, tmp_path, processes,
                                                               workers):
    pipe, store, versions = build(ckpt, tmp_path, "async", steps=4, processes=processes,
                                  workers=workers)
    rows = []
    stats = pipe.run(on_step=rows.append)
    assert pipe.trainer.step_count == 4 and stats.episodes_trained == 4 * 2 * 4
    published = {i.version for i in map(versions.info, range(1, versions.latest().version + 1))}
    used = {s["policy_version"] for s in all_samples(store)}
    assert used <= published and len(used) > 1          # workers followed the new versions
    assert all(r["staleness_max"] is None or r["staleness_max"] <= 2 for r in rows)
    assert max(stats.staleness) <= 2
    if workers == 1:                             # groups finish in the order they start:
        assert stats.samples_stale == 0          # workers wait rather than waste rollouts


def test_the_trainer_takes_the_idle_workers_cores(ckpt, tmp_path):
    # max_staleness 0: a group starts only once the step before it has published, so while
    # a step trains no group is queued or rolling out and every micro-batch gets idle_threads
    pipe, _, _ = build(ckpt, tmp_path, "async", steps=3, processes=True, max_staleness=0,
                       torch_threads=1, idle_threads=2)
    chosen = []
    real = pipe.trainer.step

    def step(*args, **kw):
        pick = pipe.trainer.threads
        pipe.trainer.threads = lambda: chosen.append(pick()) or chosen[-1]
        try:
            return real(*args, **kw)
        finally:
            pipe.trainer.threads = pick
    pipe.trainer.step = step
    pipe.run()
    assert pipe.trainer.step_count == 3 and chosen and set(chosen) == {2}
    assert pipe.trainer.threads is None
    assert torch.get_num_threads() == 1                  # the busy count again afterwards


def test_rollouts_run_while_the_trainer_trains(ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, "async", steps=2)
    training, overlapped = threading.Event(), threading.Event()
    runner, step = pipe.runner, pipe.trainer.step

    def watching_runner(*args):
        if training.is_set():
            overlapped.set()                     # a group started during a training step
        return runner(*args)

    def slow_step(*args, **kw):
        training.set()
        overlapped.wait(timeout=60)             # hold the step until a rollout starts
        try:
            return step(*args, **kw)
        finally:
            training.clear()

    pipe.runner, pipe.trainer.step = watching_runner, slow_step
    pipe.run()
    assert overlapped.is_set()


def test_stale_samples_are_dropped(ckpt, tmp_path):
    pipe, store, _ = build(ckpt, tmp_path, "sync")
    pipe.trainer.version = 5                     # pretend the trainer is at version 5
    group = pipe.runner(pipe.policies[0], pipe.tasks[0], store, pipe.config.rollout, lambda: False)
    for i, ss in enumerate(group.samples):      # versions 2, 3, 4, 5: only 2 is > 2 behind
        for s in ss:
            s["policy_version"] = 2 + i
    group.episodes = [Episode(e.session_id, float(i)) for i, e in enumerate(group.episodes)]
    row = pipe._train([group], idle_s=0.0)
    assert row["stale_dropped"] == 1 and row["samples"] == 3
    assert row["staleness_max"] == 2 and row["staleness_mean"] == 1.0


def test_zero_variance_groups_are_dropped_from_the_batch(ckpt, tmp_path):
    pipe, store, _ = build(ckpt, tmp_path, "sync")
    group = pipe.runner(pipe.policies[0], pipe.tasks[0], store, pipe.config.rollout, lambda: False)
    flat = Group(group.task_id, [Episode(e.session_id, 1.0) for e in group.episodes], group.samples)
    row = pipe._train([flat], idle_s=0.0)
    assert row["groups_dropped"] == 1 and row["samples"] == 0 and row["updated"] == 0


def test_a_failing_worker_stops_the_run(ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, "async")

    def broken(*args):
        raise OSError("sandbox exploded")
    pipe.runner = broken
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        pipe.run()
    assert isinstance(info.value.__cause__, OSError)


def test_a_failing_worker_process_stops_the_run(ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, "async", processes=True)
    pipe.model_path = tmp_path / "missing"                 # the worker cannot load its policy
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        pipe.run()
    assert "missing" in str(info.value.__cause__) and pipe.trainer.step_count == 0


def test_a_time_limit_stops_the_run(ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, "async", steps=1000)
    stats = pipe.run(max_seconds=0.0)
    assert pipe.trainer.step_count <= 1 and stats.episodes_trained <= 2 * 4   # one step at most


def test_toy_reward_is_the_share_of_tokens_starting_with_a_to_m():
    assert toy.toy_reward([" Alpha", "m", " zeta", "!"]) == pytest.approx(2 / 4)
    assert toy.toy_reward(["1", "   "]) == 0.0 and toy.toy_reward([]) == 0.0


def test_toy_pieces_are_the_tokens_text_without_stop_tokens():
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)
    assert toy.token_pieces(Chars(), [97, 122, 0], stop_ids=[0]) == ["a", "z"]


def test_weights_are_never_labelled_with_another_version():
    board = pipeline.WeightBoard(1, {"w": torch.ones(3)})

    class Policy:                                # publishes while "waiting for its lock"
        version, weights, pending = 0, {"w": torch.zeros(3)}, [2]

        def swap_state(self, update, version):
            if self.pending:
                v = self.pending.pop()
                board.put(v, {"w": torch.full((3,), float(v))})
            update(self.weights)
            self.version = version

    policy = Policy()
    board.sync(policy)
    assert policy.version == 2 and policy.weights["w"].tolist() == [2.0, 2.0, 2.0]


def test_the_curriculum_draws_the_family_the_policy_both_passes_and_fails(ckpt, tmp_path):
    from types import SimpleNamespace
    base, store, _ = build(ckpt, tmp_path, "sync")
    tasks = [SimpleNamespace(id=f"{family}/{i}", family=family)
             for family in ("solved", "never", "mixed") for i in range(4)]
    drawn = []

    def runner(policy, task, store, rollout, should_stop):
        drawn.append(task.family)
        passed = {"solved": [True] * 4, "never": [False] * 4, "mixed": [True, False] * 2}
        return Group(task.id, [Episode(f"s{len(drawn)}-{i}", float(p), p)
                               for i, p in enumerate(passed[task.family])], [[]] * 4)

    cfg = config(ckpt, "sync", steps=40, curriculum=True)
    pipe = pipeline.Pipeline(base.trainer, base.policies, tasks, runner, store, cfg)
    pipe.run()
    late = drawn[len(drawn) // 2:]
    assert late.count("mixed") > 2 * max(late.count("solved"), late.count("never")), drawn
    assert pipe.curriculum.state()["draws"] == len(drawn) == 80
    plain = pipeline.Pipeline(base.trainer, base.policies, tasks, runner, store,
                              config(ckpt, "sync", steps=1))
    assert plain.curriculum is None and plain._next_index() == 0 and plain._next_index() == 1


def test_sim_task_settings_give_other_instances_and_composed_wordings():
    plain, _ = pipeline.task_family("sim")
    fresh, _ = pipeline.task_family("sim:seed=3")
    worded, _ = pipeline.task_family("sim:seed=3,phrasings=1")
    assert len(plain) == len(fresh) == pipeline.SIM_TASKS
    assert not {t.id for t in plain} & {t.id for t in fresh}          # the SFT data is seed 0
    assert [t.id for t in worded] == [t.id for t in fresh]
    assert [t.files for t in worded] == [t.files for t in fresh]      # only the words differ
    changed = sum(a.instruction != b.instruction for a, b in zip(fresh, worded))
    assert changed > len(fresh) // 2
    for bad in ("sim:seed=x", "sim:steps=3", "sim:phrasings=1.5", "toy:seed=1", "simulated"):
        with pytest.raises(ValueError):
            pipeline.task_family(bad)


def test_learn_grpo_rejects_a_bad_task_spec_before_loading_anything():
    from click.testing import CliRunner
    from agent_runtime.cli import main
    result = CliRunner().invoke(main, ["learn", "grpo", "--tasks", "sim:seeds=3"])
    assert result.exit_code == 2
    assert "seed=N, phrasings=SHARE, families=A+B and count=N" in result.output


class _Reader:
    """Reads the same file forever (never finishes); calls `on_call` before each answer."""
    name, version, context_window = "reader", 0, 4096

    def __init__(self, on_call):
        self.on_call, self.calls = on_call, 0

    def count_tokens(self, messages, tools=None):
        return 10

    def complete(self, messages, tools=None, **kw):
        import json
        from agent_runtime.policies.base import Completion
        self.calls += 1
        self.on_call(self.calls)
        text = ("<tool_call>\n" + json.dumps({"name": "list_files", "arguments": {}})
                + "\n</tool_call>")
        return Completion(text=text, prompt_ids=[1], completion_ids=[2], logprobs=[0.0])


def test_a_sim_group_ends_its_episodes_when_the_run_stops(tmp_path):
    """The run stops during the group's third model call: the episodes end there as
    "cancelled" instead of playing their 40 steps (a stopped pipeline's rollout worker
    otherwise went on until its group ended)."""
    from learner import tasks
    stopped = threading.Event()
    policy = _Reader(lambda n: n == 3 and stopped.set())
    task = tasks.generate("train", 1, seed=0)[0]
    with SessionStore(tmp_path / "home") as store:
        group = pipeline.run_sim_group(policy, task, store,
                                       RolloutConfig(group_size=2, concurrency=1, max_steps=40),
                                       stopped.is_set)
        statuses = [store.get_session(e.session_id)["status"] for e in group.episodes]
    assert statuses == ["cancelled", "cancelled"]
    assert policy.calls < 10           # 3 model calls, and at most one more a poll


def uniform_or_mixed_runner(drawn):
    """Groups of 4 episodes: tasks "flat/*" all pass, tasks "mixed/*" half pass."""
    def runner(policy, task, store, rollout, should_stop):
        drawn.append(task.id)
        passed = [True] * 4 if task.family == "flat" else [True, False] * 2
        return Group(task.id, [Episode(f"s{len(drawn)}-{i}", float(p), p)
                               for i, p in enumerate(passed)], [[]] * 4)
    return runner


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_uniform_groups_are_set_aside_so_a_step_trains_informative_ones(ckpt, tmp_path, mode):
    from types import SimpleNamespace
    base, store, _ = build(ckpt, tmp_path, "sync")
    tasks = [SimpleNamespace(id=f"{family}/{i}", family=family)
             for i in range(8) for family in ("flat", "flat", "mixed")]   # 2 flat, then 1 mixed
    drawn, rows = [], []
    cfg = config(ckpt, mode, steps=3, max_skipped=8)
    pipe = pipeline.Pipeline(base.trainer, base.policies, tasks, uniform_or_mixed_runner(drawn),
                             store, cfg)
    pipe.run(on_step=rows.append)
    assert [r["groups"] for r in rows] == [2, 2, 2]
    assert [r["pass_rate"] for r in rows] == [0.5, 0.5, 0.5]     # only mixed groups trained
    assert sum(r["groups_skipped"] for r in rows) == pipe.stats.groups_skipped >= 3 * 2 * 2 - 2
    if mode == "sync":
        assert [r["groups_skipped"] for r in rows] == [4, 4, 4]


def test_set_aside_is_bounded_so_a_policy_that_never_varies_still_steps(ckpt, tmp_path):
    from types import SimpleNamespace
    base, store, _ = build(ckpt, tmp_path, "sync")
    tasks = [SimpleNamespace(id=f"flat/{i}", family="flat") for i in range(4)]
    drawn, rows = [], []
    cfg = config(ckpt, "sync", steps=2, max_skipped=3)
    pipe = pipeline.Pipeline(base.trainer, base.policies, tasks, uniform_or_mixed_runner(drawn),
                             store, cfg)
    pipe.run(on_step=rows.append)
    assert [(r["groups_skipped"], r["groups"], r["pass_rate"]) for r in rows] == [(3, 2, 1.0)] * 2
    assert len(drawn) == 2 * (3 + 2)


def test_a_group_with_no_pass_gets_the_oracles_episode_as_its_guide(ckpt, tmp_path):
    """`RolloutConfig.guide` 1: the tiny model fails both episodes, so the group gets a third,
    the oracle's plan played through the real loop and graded (a pass), with `policy`'s prompt
    ids and the oracle's turns in `policy`'s tokens, each ended by its end-of-turn token. Only
    that episode's calls train off-policy, with the largest advantage of the group."""
    from agent_runtime.policies.engine import EnginePolicy
    from learner import tasks
    from learner.config import LossConfig
    from learner.grpo import group_samples
    from learner.tasks.oracle import script
    policy = EnginePolicy.load(str(ckpt))
    task = tasks.generate("train", 1, seed=0)[0]
    with SessionStore(tmp_path / "home") as store:
        group = pipeline.run_sim_group(policy, task, store,
                                       RolloutConfig(group_size=2, concurrency=1, max_steps=2,
                                                     max_new_tokens=8, guide=1.0))
        assert [e.guide for e in group.episodes] == [False, False, True]
        assert [e.passed for e in group.episodes] == [False, False, True]
        guide = group.samples[2]
        assert [policy.tokenizer.decode(s["completion_ids"][:-1]) for s in guide] == script(task)
        for turn, after in zip(guide, guide[1:]):     # each turn as the next prompt shows it
            n = len(turn["prompt_ids"])                # (the template's end of turn, which
            ended = turn["completion_ids"]              # the policy writes: not <|endoftext|>)
            assert after["prompt_ids"][n:n + len(ended)] == ended
        assert guide[-1]["completion_ids"][-1] == guide[0]["completion_ids"][-1]
        reward = store.rewards(group.episodes[2].session_id)[0]
        assert reward["passed"] and reward["task_id"] == task.id
        own = store.samples(group.episodes[0].session_id)
    assert guide[0]["prompt_ids"] == own[0]["prompt_ids"]     # the same first prompt
    trained = group_samples(group, LossConfig())
    off = [s for s in trained if s.off_policy]
    assert len(off) == len(guide) and all(s.advantage > 0 for s in off)
    assert all(s.advantage < 0 for s in trained if not s.off_policy)
    assert max(s.advantage for s in trained) == off[0].advantage
    alone = group_samples(group, LossConfig(guided_failures=False))
    assert [s.session_id for s in alone] == [s.session_id for s in off]
    assert all(s.off_policy for s in alone)


def test_a_slip_started_group_with_no_pass_gets_the_oracles_recovery_as_its_guide(
        ckpt, tmp_path, monkeypatch):
    """`RolloutConfig.slip_start` 1 with `guide` 1: the group starts after the plan's slip
    (`slip_start`), the tiny model fails both episodes from there, and the guide plays the
    same slipped plan, its first `group.start` turns (the slip among them) with no token ids,
    the recovery and the rest in the policy's tokens: only what the members had to write
    trains, off-policy, above their failures."""
    from agent_runtime.policies.engine import EnginePolicy
    from learner import tasks
    from learner.config import LossConfig
    from learner.grpo import group_samples
    import random
    monkeypatch.setattr(pipeline, "_STARTS", random.Random(0))   # a draw that slips (a few
    policy = EnginePolicy.load(str(ckpt))                         # typos exist in the code)
    task = tasks.generate("train", 1, seed=31, families=["rename_symbol"])[0]
    with SessionStore(tmp_path / "home") as store:
        group = pipeline.run_sim_group(policy, task, store,
                                       RolloutConfig(group_size=2, concurrency=1, max_steps=2,
                                                     max_new_tokens=8, slip_start=1.0,
                                                     guide=1.0))
        k = group.start
        assert k >= 1
        assert [e.guide for e in group.episodes] == [False, False, True]
        assert [e.passed for e in group.episodes] == [False, False, True]
        own = store.samples(group.episodes[0].session_id)
        guide = group.samples[2]
        recovery = store.messages(group.episodes[2].session_id)
    assert [bool(s["completion_ids"]) for s in own][:k] == [False] * k
    assert [bool(s["completion_ids"]) for s in guide] == [False] * k + [True] * (len(guide) - k)
    assert any(m["role"] == "tool" and "no matches" in (m["content"] or "") for m in recovery)
    first = policy.tokenizer.decode(guide[k]["completion_ids"][:-1])
    assert "Search" in first or "search" in first or "Looking for" in first
    trained = group_samples(group, LossConfig())
    off = [s for s in trained if s.off_policy]
    assert len(off) == len(guide) - k and all(s.advantage > 0 for s in off)
