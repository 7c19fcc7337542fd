"""The GRPO pipeline: rollout workers against the trainer, asynchronous or synchronous.

Asynchronous (default): rollout worker threads, each with its own policy copy, keep running
task groups (G episodes of one task, recorded in the session store like any session) with the
newest published version, while the trainer trains on finished groups. Weights reach the
workers between model calls (`EnginePolicy.swap_state`), so every sample, hence every token,
carries the version that generated it. Samples more than `max_staleness` versions behind the
trainer are dropped; the queue of finished groups is bounded so workers cannot run far ahead.
Synchronous: generate a batch with the current version, train on it, repeat (for comparison).

Task families: "sim" (`learner.tasks` + `learner.rollout`) and "toy" (one model call, reward =
share of even token ids in the completion: trivially learnable, for tests and benchmarks).

Not here: the loss (`grpo.py`) and the update, checkpoints and publishing (`trainer.py`).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from learner.config import RolloutConfig, RunConfig
from learner.grpo import Episode, Group, group_samples
from learner.trainer import Trainer

log = logging.getLogger(__name__)


class GroupRunner(Protocol):
    def __call__(self, policy: Any, task: Any, store: Any, config: RolloutConfig,
                 should_stop: Callable[[], bool]) -> Group:
        """Run `config.group_size` episodes of `task` with `policy`; record them in `store`."""
        ...


# -- task families ------------------------------------------------------------------------------

@dataclass
class ToyTask:
    """One-call task: any answer; reward = share of even token ids among its text tokens."""
    id: str
    prompt: str


def toy_tasks(n: int, seed: int = 0) -> list[ToyTask]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "calc", "tests", "fix", "add", "sum", "list"]
    return [ToyTask(f"toy-{seed}-{i}", f"Say something about {' '.join(rng.sample(words, 3))}.")
            for i in range(n)]


def toy_reward(completion_ids: Sequence[int], stop_ids: Sequence[int]) -> float:
    text = [t for t in completion_ids if t not in set(stop_ids)]
    return sum(t % 2 == 0 for t in text) / len(text) if text else 0.0


def run_toy_group(policy: Any, task: ToyTask, store: Any, config: RolloutConfig,
                  should_stop: Callable[[], bool] = lambda: False) -> Group:
    episodes, samples = [], []
    messages = [{"role": "user", "content": task.prompt}]
    for _ in range(config.group_size):
        sid = store.create_session(task.prompt, "", policy.name, policy.version,
                                   meta={"family": "toy", "task_id": task.id})
        store.add_message(sid, 0, "user", task.prompt)
        c = policy.complete(messages, max_new_tokens=config.max_new_tokens, should_stop=should_stop)
        mid = store.add_message(sid, 0, "assistant", c.text)
        store.add_sample(sid, 0, mid, c.prompt_ids, c.completion_ids, c.logprobs, c.routes,
                         c.version, c.finish_reason)
        reward = toy_reward(c.completion_ids, policy.stop_token_ids)
        store.set_status(sid, "finished", summary=f"reward {reward:.3f}")
        episodes.append(Episode(sid, reward, passed=reward > 0.5))
        samples.append(store.samples(sid))
    return Group(task.id, episodes, samples)


def run_sim_group(policy: Any, task: Any, store: Any, config: RolloutConfig,
                  should_stop: Callable[[], bool] = lambda: False) -> Group:
    from learner.rollout import run_episodes
    eps = run_episodes(lambda _task: policy, [task] * config.group_size, store,
                       concurrency=config.concurrency, max_steps=config.max_steps)
    return Group(task.id, [Episode(e.session_id, float(e.reward), bool(e.passed)) for e in eps],
                 [store.samples(e.session_id) for e in eps])


def task_family(name: str, seed: int = 0) -> tuple[list[Any], GroupRunner]:
    """The training tasks and group runner of a family ("sim" or "toy")."""
    if name == "toy":
        return toy_tasks(64, seed), run_toy_group
    if name == "sim":
        from learner import tasks
        return tasks.generate("train", 256, seed=seed), run_sim_group
    raise ValueError(f"unknown task family {name!r} (sim or toy)")


# -- weights ------------------------------------------------------------------------------------

class WeightBoard:
    """The newest published (version, state); workers copy it into their policies."""

    def __init__(self, version: int, state: dict[str, torch.Tensor]):
        self._lock = threading.Lock()
        self.version, self.state = version, state

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.version, self.state = version, state

    def follow(self, policy: Any) -> "Following":
        return Following(policy, self)

    def sync(self, policy: Any) -> None:
        """Bring `policy` to the newest version (waits for its model call in flight)."""
        with self._lock:
            version, state = self.version, self.state
        if policy.version == version:
            return

        def copy_in(live: dict[str, torch.Tensor]) -> None:
            for name, t in live.items():
                t.copy_(state[name])
        policy.swap_state(copy_in, version)


class Following:
    """A policy that moves to the board's newest version before each of its model calls."""

    def __init__(self, policy: Any, board: WeightBoard):
        self.policy, self.board = policy, board

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        self.board.sync(self.policy)
        return self.policy.complete(*args, **kwargs)


# -- the pipeline -------------------------------------------------------------------------------

@dataclass
class Stats:
    """Counters of one `Pipeline.run` (wall-clock ones for benchmarks)."""
    steps: int = 0
    episodes_generated: int = 0
    episodes_trained: int = 0
    samples_stale: int = 0
    wall_s: float = 0.0
    trainer_idle_s: float = 0.0            # waiting for rollouts
    trainer_busy_s: float = 0.0            # forward, backward, update, publish, checkpoint
    staleness: list[int] = field(default_factory=list)   # per trained sample

    @property
    def idle_fraction(self) -> float:
        return self.trainer_idle_s / self.wall_s if self.wall_s else 0.0


class Pipeline:
    """Rollout workers + trainer for one run; `run()` trains until `steps` or a time limit."""

    def __init__(self, trainer: Trainer, policies: list[Any], tasks: Sequence[Any],
                 runner: GroupRunner, store: Any, config: RunConfig, cursor: int = 0):
        if not policies:
            raise ValueError("need at least one rollout policy")
        self.trainer, self.policies, self.tasks = trainer, policies, list(tasks)
        self.runner, self.store, self.config = runner, store, config
        self.cursor = cursor                     # index of the next task (saved in checkpoints)
        self.board = WeightBoard(trainer.version, trainer.published)
        self.stats = Stats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def _next_task(self) -> Any:
        with self._lock:
            task = self.tasks[self.cursor % len(self.tasks)]
            self.cursor += 1
            return task

    def _group(self, policy: Any) -> Group:
        group = self.runner(self.board.follow(policy), self._next_task(), self.store,
                            self.config.rollout, self._stop.is_set)
        with self._lock:
            self.stats.episodes_generated += len(group.episodes)
        return group

    # -- training side ------------------------------------------------------------------------

    def _train(self, groups: list[Group], idle_s: float) -> dict:
        t0 = time.perf_counter()
        version, cap = self.trainer.version, self.config.pipeline.max_staleness
        rewards = [e.reward for g in groups for e in g.episodes]
        passed = [e.passed for g in groups for e in g.episodes]
        samples, dropped_groups, stale = [], 0, 0
        for g in groups:
            fresh = []
            for ss in g.samples:
                keep = [s for s in ss if version - s["policy_version"] <= cap]
                stale += len(ss) - len(keep)
                fresh.append(keep)
            got = group_samples(Group(g.task_id, g.episodes, fresh), self.trainer.config.loss)
            dropped_groups += not got
            samples += got
        ages = [version - s.version for s in samples]
        extra = {"mode": self.config.pipeline.mode, "groups": len(groups),
                 "groups_dropped": dropped_groups, "episodes": len(rewards),
                 "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                 "pass_rate": sum(passed) / len(passed) if passed else None,
                 "stale_dropped": stale,
                 "staleness_mean": sum(ages) / len(ages) if ages else None,
                 "staleness_max": max(ages) if ages else None, "idle_s": idle_s}
        row = self.trainer.step(samples, extra, {"cursor": self.cursor})
        self.board.put(self.trainer.version, self.trainer.published)
        busy = time.perf_counter() - t0
        with self._lock:
            s = self.stats
            s.steps += 1
            s.episodes_trained += len(rewards)
            s.samples_stale += stale
            s.staleness += ages
            s.trainer_idle_s += idle_s
            s.trainer_busy_s += busy
        return row

    def run(self, steps: int | None = None, max_seconds: float | None = None,
            on_step: Callable[[dict], None] | None = None) -> Stats:
        """Train until the trainer reaches `steps` (default: the config's) or `max_seconds`."""
        target = self.config.pipeline.steps if steps is None else steps
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds
        start = time.perf_counter()
        self._stop.clear()
        try:
            if self.config.pipeline.mode == "sync":
                self._run_sync(target, deadline, on_step)
            elif self.config.pipeline.mode == "async":
                self._run_async(target, deadline, on_step)
            else:
                raise ValueError(f"pipeline mode must be 'async' or 'sync', "
                                 f"got {self.config.pipeline.mode!r}")
        finally:
            self.stats.wall_s += time.perf_counter() - start
        return self.stats

    @staticmethod
    def _more(trainer: Trainer, target: int, deadline: float | None) -> bool:
        return trainer.step_count < target and (deadline is None or time.perf_counter() < deadline)

    def _run_sync(self, target: int, deadline: float | None, on_step) -> None:
        n = self.config.pipeline.groups_per_step
        while self._more(self.trainer, target, deadline):
            t0 = time.perf_counter()
            groups = [self._group(self.policies[0]) for _ in range(n)]
            row = self._train(groups, time.perf_counter() - t0)
            if on_step:
                on_step(row)

    def _run_async(self, target: int, deadline: float | None, on_step) -> None:
        p = self.config.pipeline
        q: queue.Queue[Group] = queue.Queue(maxsize=p.queue_groups or p.groups_per_step)
        workers = [threading.Thread(target=self._worker, args=(policy, q), daemon=True,
                                    name=f"rollout-{i}") for i, policy in enumerate(self.policies)]
        for w in workers:
            w.start()
        try:
            while self._more(self.trainer, target, deadline):
                t0 = time.perf_counter()
                groups = []
                while len(groups) < p.groups_per_step:
                    if self._error is not None:
                        raise RuntimeError("a rollout worker failed") from self._error
                    try:
                        groups.append(q.get(timeout=0.1))
                    except queue.Empty:
                        if deadline is not None and time.perf_counter() >= deadline:
                            return
                row = self._train(groups, time.perf_counter() - t0)
                if on_step:
                    on_step(row)
        finally:
            self._stop.set()
            for w in workers:
                w.join(timeout=60)

    def _worker(self, policy: Any, q: queue.Queue) -> None:
        try:
            while not self._stop.is_set():
                group = self._group(policy)
                while not self._stop.is_set():
                    try:
                        q.put(group, timeout=0.1)
                        break
                    except queue.Full:
                        pass
        except BaseException as exc:             # surfaced by the trainer loop
            self._error = exc
            self._stop.set()


def build(config: RunConfig, run_dir: str | Path, store: Any, versions: Any = None,
          policy_factory: Callable[[], Any] | None = None) -> Pipeline:
    """A pipeline for `config`: trainer opened (resumed when the run folder has a checkpoint),
    rollout policies loaded and brought to the trainer's version, tasks chosen."""
    from agent_runtime.engine_policy import EnginePolicy, resolve_model_path

    if config.rollout.top_p != 1.0 or config.rollout.top_k != 0:
        raise ValueError("rollouts must sample from the full distribution (top_p 1, top_k 0): "
                         "training logprobs are computed without filtering")
    p = config.pipeline
    if p.torch_threads:
        torch.set_num_threads(p.torch_threads)
    model_path = resolve_model_path(config.model)
    trainer, extra = Trainer.open(model_path, run_dir, config.trainer, versions, store)
    r = config.rollout
    factory = policy_factory or (lambda: EnginePolicy.load(
        str(model_path), dtype=r.dtype, device=r.device, temperature=config.trainer.temperature,
        top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens))
    n_workers = r.workers if p.mode == "async" else 1
    policies = [factory() for _ in range(max(1, n_workers))]
    tasks, runner = task_family(config.tasks, p.seed)
    pipe = Pipeline(trainer, policies, tasks, runner, store, config,
                    cursor=(extra or {}).get("cursor", 0))
    for policy in policies:
        pipe.board.sync(policy)
    return pipe
