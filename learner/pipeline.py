"""The GRPO pipeline: rollout workers against the trainer, asynchronous or synchronous.

Asynchronous (default): rollout workers, each with its own policy copy, keep running task
groups (G episodes of one task, recorded in the session store like any session) with the
newest published version, while the trainer trains on finished groups. Workers are processes
by default (no GIL shared with the trainer: generation and training really overlap on CPU),
threads, or Ray actors (`learner.ray_backend`: weights as deltas through Ray's object store).
The trainer puts each new version on a `WeightBoard` in shared memory; workers
copy it in between model calls (`EnginePolicy.swap_state`), so every sample, hence every
token, carries the version that generated it. Samples more than `max_staleness` versions
behind the trainer are dropped, and workers start a group only while fewer than
groups_per_step * (max_staleness + 1) are waiting or running, so they never run further
ahead than the bound allows. Synchronous: generate a batch with the current version, train
on it, repeat (for comparison).

Task families: "sim" (`learner.tasks` + `learner.rollout`; "sim:seed=3,phrasings=0.6" for other
instances and composed wordings, `learner.config.parse_task_spec`) and "toy" (`learner.toy`: one
model call with a trivially learnable reward, for tests and benchmarks).

Not here: the loss (`grpo.py`) and the update, checkpoints and publishing (`trainer.py`).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.multiprocessing as mp

from agent_runtime.policies.base import batches
from agent_runtime.policies.following import FollowingPolicy
from learner.config import RolloutConfig, RunConfig, parse_task_spec
from learner.curriculum import FamilyCurriculum
from learner.grpo import Episode, Group, group_advantages, group_samples
from learner.trainer import Trainer

log = logging.getLogger(__name__)


class GroupRunner(Protocol):
    def __call__(self, policy: Any, task: Any, store: Any, config: RolloutConfig,
                 should_stop: Callable[[], bool]) -> Group:
        """Run `config.group_size` episodes of `task` with `policy`; record them in `store`."""
        ...


# -- task families ------------------------------------------------------------------------------

def run_sim_group(policy: Any, task: Any, store: Any, config: RolloutConfig,
                  should_stop: Callable[[], bool] = lambda: False) -> Group:
    """The group's episodes, on threads; once `should_stop()` turns true, each episode
    still running ends at its next check (`run_episode`), so a stopped run's rollout worker
    does not play its group to the end."""
    from agent_runtime.agent import AgentConfig
    from agent_runtime.policies.batching import BatchingPolicy
    from learner.rollout import run_episodes
    from learner.tasks.oracle import OracleStart, slip_start, start_turns
    if config.concurrency > 1 and batches(policy):
        policy = BatchingPolicy(policy, max_batch=config.concurrency)
    start = start_turns(task, config.oracle_start, _STARTS)
    plan = None                                   # a slip start's turns (`slip_start`)
    if not start:
        plan, start = slip_start(task, config.slip_start, _STARTS)
    eps = run_episodes((lambda t: OracleStart(t, policy, start, plan)) if start
                       else (lambda _t: policy),
                       [task] * config.group_size, store,
                       concurrency=config.concurrency,
                       agent_config=AgentConfig(max_steps=config.max_steps,
                                                check_references=config.check_references),
                       should_stop=should_stop,
                       stop_after_failed_checks=config.stop_after_failed_checks)
    group = Group(task.id, [Episode(e.session_id, shaped_reward(e, config.partial_credit),
                                    bool(e.passed)) for e in eps],
                  [store.samples(e.session_id) for e in eps], start)
    # a guide: the oracle's whole episode (after a slip start, its plan, trained from the
    # recovery on); not after an oracle start, whose members play only the plan's end
    if (config.guide > 0 and (not start or plan) and not any(e.passed for e in eps)
            and not should_stop() and _STARTS.random() < config.guide):
        guided = guide_episode(policy, task, store, should_stop, plan, start if plan else 0)
        if guided is not None:
            group.episodes.append(guided)
            group.samples.append(store.samples(guided.session_id))
    return group


def guide_episode(policy: Any, task: Any, store: Any,
                  should_stop: Callable[[], bool] = lambda: False,
                  plan: list[str] | None = None, played: int = 0) -> Episode | None:
    """The oracle's episode of `task` as `policy` would have written it (`GuidePolicy`; with
    `plan`, a slip start's turns, the first `played` of them not trained), recorded and graded
    like any rollout, as a guide member of a group; None when the oracle did not pass (a
    broken instance: a guide must be a pass)."""
    from learner.rollout import run_episode
    from learner.tasks.oracle import GuidePolicy
    try:
        e = run_episode(GuidePolicy(task, policy, plan, played), task, store, max_steps=30,
                        should_stop=should_stop)
    except Exception:                              # a task the oracle cannot play
        log.warning("guide episode of %s failed:\n%s", task.id, traceback.format_exc())
        return None
    return Episode(e.session_id, 1.0, True, guide=True) if e.passed and not e.cheated else None


_STARTS = random.Random()       # where groups start (`RolloutConfig.oracle_start`); rollouts
                                # are not reproducible run to run anyway (threads, timing)


def shaped_reward(episode: Any, partial_credit: float) -> float:
    """The training reward of a graded episode (`learner.rollout.Episode`): its reward (1
    solved honestly, else 0), or for a failure that did not cheat, `partial_credit` times the
    share of the tests it left passing: still below any pass, so GRPO's group advantage
    ranks a failure that broke less above one that broke more."""
    share = getattr(episode, "tests_share", None)
    if episode.passed or episode.cheated or partial_credit <= 0 or share is None:
        return float(episode.reward)
    return partial_credit * share


SIM_TASKS = 256                 # training instances a "sim" run cycles through


def task_family(name: str, seed: int = 0) -> tuple[list[Any], GroupRunner]:
    """The training tasks and group runner of a task spec (`parse_task_spec`)."""
    family, settings = parse_task_spec(name, seed)
    if family == "toy":
        from learner.toy import run_toy_group, toy_tasks
        return toy_tasks(64, seed), run_toy_group
    from learner import tasks
    count = settings.pop("count", SIM_TASKS)
    return tasks.generate("train", count, **settings), run_sim_group


# -- weights ------------------------------------------------------------------------------------

LOCK_TIMEOUT_S = 60.0


class _Moved(Exception):
    """The board changed version while a policy was about to copy from it."""


class WeightBoard:
    """The newest published (version, state) in shared memory: rollout workers (threads or
    processes) copy it into their policies between model calls. The board's lock is held
    only while tensors are copied, never while a policy generates."""

    def __init__(self, version: int, state: dict[str, torch.Tensor], ctx: Any = None):
        ctx = ctx or mp.get_context("spawn")
        self.tensors = {k: v.detach().to("cpu", copy=True).share_memory_()
                        for k, v in state.items()}
        self._version = ctx.Value("q", version, lock=False)
        self._lock = ctx.Lock()

    @property
    def version(self) -> int:
        return self._version.value

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for name, t in self.tensors.items():
                t.copy_(state[name])
            self._version.value = version

    def follow(self, policy: Any) -> FollowingPolicy:
        """`policy`, brought to the board's newest version before each of its model calls."""
        return FollowingPolicy(policy, self.sync)

    def sync(self, policy: Any) -> None:
        """Bring `policy` to the newest version (after its model call in flight, if any)."""
        while policy.version != self.version:
            version = self.version

            def copy_in(live: dict[str, torch.Tensor]) -> None:
                if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):   # its holder died
                    raise TimeoutError("the weight board's lock was not released")
                try:
                    if self._version.value != version:
                        raise _Moved                 # before writing anything: retry
                    for name, t in live.items():
                        t.copy_(self.tensors[name])
                finally:
                    self._lock.release()
            try:
                policy.swap_state(copy_in, version)
            except _Moved:
                continue


# -- the pipeline -------------------------------------------------------------------------------

@dataclass
class Stats:
    """Counters of one `Pipeline.run` (wall-clock ones for benchmarks)."""
    steps: int = 0
    episodes_generated: int = 0
    episodes_trained: int = 0
    samples_stale: int = 0
    groups_skipped: int = 0                # uniform groups set aside (`max_skipped`)
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
                 runner: GroupRunner, store: Any, config: RunConfig, cursor: int = 0,
                 model_path: str | Path | None = None, curriculum_state: dict | None = None):
        r = config.rollout
        if r.backend not in ("local", "ray"):
            raise ValueError(f"rollout backend must be 'local' or 'ray', got {r.backend!r}")
        processes = config.pipeline.mode == "async" and (r.processes or r.backend == "ray")
        if processes and model_path is None:
            raise ValueError("rollout worker processes and actors need the model path")
        if not processes and not policies:
            raise ValueError("need at least one rollout policy")
        self.trainer, self.policies, self.tasks = trainer, policies, list(tasks)
        self.runner, self.store, self.config = runner, store, config
        self.model_path = model_path
        self.cursor = cursor                     # index of the next task (saved in checkpoints)
        self.curriculum: FamilyCurriculum | None = None     # draws the tasks when configured
        self._family: dict[Any, str] = {}        # task id -> family, for the curriculum
        self._index: dict[Any, int] = {}         # task id -> its index in `tasks`, likewise
        families = [getattr(t, "family", None) for t in self.tasks]
        if config.pipeline.curriculum and self.tasks and None not in families:
            self.curriculum = FamilyCurriculum(families, seed=config.pipeline.seed,
                                               revisit=config.pipeline.revisit)
            if curriculum_state:
                self.curriculum.load_state(curriculum_state)
            self._family = {t.id: t.family for t in self.tasks}
            self._index = {t.id: i for i, t in enumerate(self.tasks)}
        self.board = WeightBoard(trainer.version, trainer.published)
        self.publish_hooks: list[Callable[[int, dict], None]] = []   # (version, state),
                                                 # called after each step's publish
        self.backend: Any = None                 # the Ray backend's actors, once a run started
        self.stats = Stats()
        self._credits = threading.Semaphore(0)   # groups that may start (set per async run)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._skipped = 0                        # uniform groups set aside for the next step
        self._in_flight = 0                      # groups handed to worker processes, not back

    def _next_index(self) -> int:
        with self._lock:
            self.cursor += 1
            return self.curriculum.next_index() if self.curriculum else self.cursor - 1

    def _next_task(self) -> Any:
        return self.tasks[self._next_index() % len(self.tasks)]

    def _group(self, policy: Any) -> Group:
        return self._generated(self.runner(self.board.follow(policy), self._next_task(),
                                           self.store, self.config.rollout, self._stop.is_set))

    def _generated(self, group: Group) -> Group:
        """Count a finished group's episodes (any backend's) in the stats; returns it."""
        with self._lock:
            self.stats.episodes_generated += len(group.episodes)
        return group

    # -- training side ------------------------------------------------------------------------

    def _train(self, groups: list[Group], idle_s: float) -> dict:
        t0 = time.perf_counter()
        version, cap = self.trainer.version, self.config.pipeline.max_staleness
        rewards = [e.reward for g in groups for e in g.sampled]
        passed = [e.passed for g in groups for e in g.sampled]
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
                 "staleness_max": max(ages) if ages else None, "idle_s": idle_s,
                 "oracle_starts": sum(g.start > 0 for g in groups),
                 "guided": sum(len(g.episodes) - len(g.sampled) for g in groups)}
        extra["groups_skipped"], self._skipped = self._skipped, 0
        saved = {"cursor": self.cursor}
        if self.curriculum:
            for g in groups:
                self._record(g)
            with self._lock:
                saved["curriculum"] = self.curriculum.state()
        row = self.trainer.step(samples, extra, saved)
        self.board.put(self.trainer.version, self.trainer.published)
        for hook in self.publish_hooks:
            hook(self.trainer.version, self.trainer.published)
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

    def _record(self, group: Group) -> None:
        if self.curriculum:
            with self._lock:
                self.curriculum.record(self._family.get(group.task_id),
                                       [e.passed for e in group.sampled],
                                       self._index.get(group.task_id))

    def _set_aside(self, group: Group) -> bool:
        """Whether `group` is skipped rather than trained: all its episodes got one reward
        (zero advantage everywhere) and fewer than `max_skipped` were skipped for this step.
        A skipped group still counts for the curriculum."""
        if (group_advantages(group.rewards) is not None
                or self._skipped >= self.config.pipeline.max_skipped):
            return False
        self._record(group)
        self._skipped += 1
        with self._lock:
            self.stats.groups_skipped += 1
        return True

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
            groups: list[Group] = []
            while len(groups) < n:
                g = self._group(self.policies[0])
                if not self._set_aside(g):
                    groups.append(g)
            row = self._train(groups, time.perf_counter() - t0)
            if on_step:
                on_step(row)

    def _run_async(self, target: int, deadline: float | None, on_step) -> None:
        p = self.config.pipeline
        q: queue.Queue[Group] = queue.Queue()    # bounded by the credits
        self._credits = threading.Semaphore(p.groups_per_step * (p.max_staleness + 1))
        if self.config.rollout.backend == "ray":
            from learner.ray_backend import start_actors
            finish = start_actors(self, q)
        elif self.config.rollout.processes:
            finish = self._start_processes(q)
            if p.idle_threads > 0:
                finish = self._lend_idle_cores(finish)
        else:
            finish = self._start_threads(q)
        try:
            while self._more(self.trainer, target, deadline):
                t0 = time.perf_counter()
                groups = []
                while len(groups) < p.groups_per_step:
                    if self._error is not None:
                        raise RuntimeError("a rollout worker failed") from self._error
                    try:
                        g = q.get(timeout=0.1)
                    except queue.Empty:
                        if deadline is not None and time.perf_counter() >= deadline:
                            return
                        continue
                    if self._set_aside(g):
                        self._credits.release()  # trained by no step: another may start
                    else:
                        groups.append(g)
                row = self._train(groups, time.perf_counter() - t0)
                for _ in groups:                 # their version is out: more may start
                    self._credits.release()
                if on_step:
                    on_step(row)
        finally:
            self._stop.set()
            finish()

    def _credit(self) -> bool:
        """Wait until another group may start (False when asked to stop first). Credits come
        back when a step that used the group is published, so a group starts with at most
        groups_per_step * (max_staleness + 1) - 1 others ahead of it, queued, running or in
        the step being trained: it is trained at most max_staleness versions later. (With
        several workers a slow group can be overtaken; the trainer's filter drops what is
        then too old.)"""
        while not self._stop.is_set():
            if self._credits.acquire(timeout=0.1):
                return True
        return False

    def _put(self, q: Any, item: Any, stop: Any = None) -> bool:
        """Put into a bounded queue unless asked to stop first."""
        stop = stop or self._stop
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    # -- rollout workers: threads ------------------------------------------------------------

    def _start_threads(self, q: queue.Queue) -> Callable[[], None]:
        workers = [threading.Thread(target=self._worker, args=(policy, q), daemon=True,
                                    name=f"rollout-{i}") for i, policy in enumerate(self.policies)]
        for w in workers:
            w.start()

        def finish() -> None:
            for w in workers:
                w.join(timeout=60)
        return finish

    def _worker(self, policy: Any, q: queue.Queue) -> None:
        try:
            while self._credit():
                self._put(q, self._group(policy))
        except BaseException as exc:             # surfaced by the trainer loop
            self._error = exc
            self._stop.set()

    # -- rollout workers: processes -----------------------------------------------------------

    def _start_processes(self, q: queue.Queue) -> Callable[[], None]:
        """Worker processes (own policy copy, weights from the shared board) record groups in
        the store; a feeder thread hands out task indices, a collector thread reads the
        finished groups' samples back from the store into `q`."""
        ctx = mp.get_context("spawn")
        n = max(1, self.config.rollout.workers)
        tasks_q, out_q, stop = ctx.Queue(maxsize=n), ctx.Queue(maxsize=n), ctx.Event()
        procs = [ctx.Process(target=_worker_main, daemon=True, name=f"rollout-{i}",
                             args=(self.config, str(self.model_path), str(self.store.home),
                                   self.board, i, tasks_q, out_q, stop, os.getpid()))
                 for i in range(n)]
        for proc in procs:
            proc.start()
        threads = [threading.Thread(target=self._feed, args=(tasks_q,), daemon=True),
                   threading.Thread(target=self._collect, args=(out_q, q, procs), daemon=True)]
        for t in threads:
            t.start()

        def finish() -> None:
            stop.set()
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.terminate()
            for t in threads:
                t.join(timeout=5)
        return finish

    def _lend_idle_cores(self, finish: Callable[[], None]) -> Callable[[], None]:
        """The trainer takes `idle_threads` threads for a micro-batch that starts while no
        group is queued for or rolling out in the worker processes (their cores idle: with a
        trainer slower than the rollouts, most of a step), `torch_threads` otherwise."""
        p = self.config.pipeline
        busy = max(1, p.torch_threads or torch.get_num_threads())
        self.trainer.threads = lambda: busy if self._in_flight else p.idle_threads

        def done() -> None:
            self.trainer.threads = None
            torch.set_num_threads(busy)
            finish()
        return done

    def _feed(self, tasks_q: Any) -> None:
        while self._credit():
            with self._lock:                     # counted before a worker can take it
                self._in_flight += 1
            if not self._put(tasks_q, self._next_index()):
                with self._lock:
                    self._in_flight -= 1

    def _collect(self, out_q: Any, q: queue.Queue, procs: list) -> None:
        while not self._stop.is_set():
            dead = [p for p in procs if p.exitcode is not None]
            try:                                 # a dead worker's last words come first
                kind, payload = out_q.get(timeout=1.0 if dead else 0.1)
            except queue.Empty:
                if not dead:
                    continue
                kind, payload = "error", f"{dead[0].name} exited with code {dead[0].exitcode}"
            if kind == "error":
                self._error = RuntimeError(f"rollout worker process:\n{payload}")
                self._stop.set()
                return
            with self._lock:
                self._in_flight -= 1
            payload.samples = [self.store.samples(e.session_id) for e in payload.episodes]
            self._put(q, self._generated(payload))


def _worker_main(config: RunConfig, model_path: str, home: str, board: WeightBoard, index: int,
                 tasks_q: Any, out_q: Any, stop: Any, parent: int) -> None:
    """A rollout worker process: its own policy, following the board, recording groups in
    the session store and sending back (task, episodes) without the samples. Ends with its
    parent (a killed trainer leaves no orphans behind)."""
    try:
        from agent_runtime.store import SessionStore
        torch.set_num_threads(max(1, config.rollout.worker_threads))
        torch.manual_seed(config.pipeline.seed * 1009 + index + 1)
        policy = rollout_policy(config, model_path)
        tasks, runner = task_family(config.tasks, config.pipeline.seed)

        def stopped() -> bool:
            return stop.is_set() or os.getppid() != parent

        with SessionStore(home) as store:
            while not stopped():
                try:
                    i = tasks_q.get(timeout=0.1)
                except queue.Empty:
                    continue
                g = runner(board.follow(policy), tasks[i % len(tasks)], store, config.rollout,
                           stopped)
                item = ("group", Group(g.task_id, g.episodes, start=g.start))
                while not stopped():
                    try:
                        out_q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
    except BaseException:
        try:
            out_q.put(("error", traceback.format_exc()), timeout=5)
        except Exception:
            pass


def rollout_policy(config: RunConfig, model_path: str | Path) -> Any:
    """An `EnginePolicy` sampling as the trainer expects (full distribution, its temperature)."""
    from agent_runtime.policies.engine import EnginePolicy
    r = config.rollout
    return EnginePolicy.load(str(model_path), dtype=r.dtype, device=r.device,
                             temperature=config.trainer.temperature,
                             max_new_tokens=r.max_new_tokens)


def build(config: RunConfig, run_dir: str | Path, store: Any, versions: Any = None,
          policy_factory: Callable[[], Any] | None = None) -> Pipeline:
    """A pipeline for `config`: trainer opened (resumed when the run folder has a checkpoint),
    rollout policies loaded and brought to the trainer's version, tasks chosen."""
    from agent_runtime.policies import resolve_model_path

    p = config.pipeline
    if p.torch_threads:
        torch.set_num_threads(p.torch_threads)
    model_path = resolve_model_path(config.model)
    trainer, extra = Trainer.open(model_path, run_dir, config.trainer, versions, store)
    r = config.rollout
    factory = policy_factory or (lambda: rollout_policy(config, model_path))
    if p.mode == "async" and (r.processes or r.backend == "ray"):
        n_local = 0                              # the worker processes (actors) load their own
    else:
        n_local = max(1, r.workers) if p.mode == "async" else 1
    policies = [factory() for _ in range(n_local)]
    tasks, runner = task_family(config.tasks, p.seed)
    pipe = Pipeline(trainer, policies, tasks, runner, store, config,
                    cursor=(extra or {}).get("cursor", 0), model_path=model_path,
                    curriculum_state=(extra or {}).get("curriculum"))
    for policy in policies:
        pipe.board.sync(policy)
    return pipe
