"""Rollout workers as Ray actors: the Ray backend of the asynchronous pipeline
(`RolloutConfig.backend = "ray"`, `apprentice learn grpo --backend ray`).

Only where groups are generated changes. The trainer side is the pipeline's own
(`Pipeline._run_async`: credits, the staleness filter, metrics, `Stats`); this module starts
`rollout.workers` actors (`RolloutActor`, one policy copy each, loaded from the model path)
in a placement group with one bundle of `ray.num_cpus` CPUs per worker, hands each idle actor
the next task index while the pipeline's credits allow, and puts the finished groups, with
their samples (per-token versions and routes as generated), on the trainer's queue.

Weights: after every step the trainer encodes the lossless delta (`agent_runtime.delta`)
from the previous published version to the new one and `ray.put`s it once; every actor is
offered it, fetches it from the object store, verifies it and applies it between model calls
(`EnginePolicy.swap_state`; offers that overtake each other on the actor's threads wait for
the version before them), then reports the version and the sha256 of the weights it now
holds, rehashed from its live tensors. The full state goes only to a new actor (first
contact) or to one whose delta did not apply. Every report is checked against the published
version's sha256; a mismatch stops the run.

Failures: an actor that dies (`RayActorError`) is replaced by a new actor in the same bundle,
which runs the dead one's task index again (the lost group never reached the trainer, so
nothing is trained twice); after `ray.max_replacements` deaths in one slot without a finished
group the run fails. An exception inside a group stops the run, as with local workers.

Sessions are recorded in the session store at the pipeline's store path on the node that ran
them (on one machine: the trainer's store); the samples travel back with the group.

Not here: training, staleness and metrics (`pipeline.py`), the codec (`agent_runtime.delta`).
Ray is imported lazily: nothing else in the project needs it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from agent_runtime import delta
from learner.config import RayConfig, RunConfig
from learner.grpo import Group

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0          # a new actor waits this long for its first weights
PLACEMENT_TIMEOUT_S = 120.0      # the cluster must find every worker's bundle within this
DRAIN_TIMEOUT_S = 15.0           # at the end, wait this long for the last weight reports


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:                    # pragma: no cover - depends on the install
        raise RuntimeError("the Ray backend needs ray: pip install 'apprentice[ray]'") from exc
    return ray


def connect(config: RayConfig) -> None:
    """Join `config.address`, or the cluster this process already joined, or start a local
    instance (also what `RAY_ADDRESS` points `ray.init` at)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=config.address, include_dashboard=False, log_to_driver=False)


# -- the actor ----------------------------------------------------------------------------------

class RolloutActor:
    """One rollout worker (made a Ray actor by `start_actors`): its own policy, task list and
    session store. `run_group` runs on one actor thread, `load`/`offer` on others; a weight
    update waits for the model call in flight, so every sample carries the version that
    generated it."""

    def __init__(self, config: RunConfig, model_path: str, home: str, index: int):
        from agent_runtime.store import SessionStore
        from learner.pipeline import rollout_policy, task_family
        torch.set_num_threads(max(1, config.rollout.worker_threads))
        torch.manual_seed(config.pipeline.seed * 1009 + index + 1)
        self.config, self.index = config, index
        self.policy = rollout_policy(config, model_path)
        self.tasks, self.runner = task_family(config.tasks, config.pipeline.seed)
        self.store = SessionStore(home)
        self._weights = threading.Lock()          # one weight update at a time
        self._ready = threading.Event()           # set once the first full state is in
        self._offers: dict[int, tuple[str, list]] = {}   # version -> (sha256, [delta ref])
        self._stop = threading.Event()

    def _report(self, **extra: Any) -> dict:
        """The version held and the sha256 of the live weights (rehashed, not taken from the
        delta's header)."""
        return {"index": self.index, "version": self.policy.version,
                "sha256": delta.state_sha256(self.policy.model.state_dict()), **extra}

    def load(self, version: int, sha256: str, state_ref: list) -> list[dict]:
        """First contact, or a delta that did not apply: the full state of `version`
        (`state_ref[0]`, an object ref, fetched here), checked against `sha256`. Returns a
        report per version taken on (this one, then any offered deltas that follow it)."""
        ray = _ray()
        with self._weights:
            if self._ready.is_set() and self.policy.version >= version:
                return []
            patch = delta.Patch.replacement(ray.get(state_ref[0]), sha256=sha256,
                                            to_version=version)
            self.policy.swap_state(patch.commit, version)
            self._ready.set()
            return [self._report(full=True)] + self._take_offers()

    def offer(self, version: int, sha256: str, blob_ref: list) -> list[dict]:
        """The delta to `version` (`blob_ref[0]`, fetched only when applied). Offers may
        arrive out of order (actor threads): each is kept until the version before it is
        held, and the call that fills a gap applies the whole run. Returns a report per
        version applied by this call, or a `need_full` one when a delta cannot apply."""
        self._ready.wait(timeout=READY_TIMEOUT_S)     # the first contact's full state first
        with self._weights:
            if not self._ready.is_set():
                return [{"index": self.index, "version": None, "need_full": True}]
            if version > self.policy.version:
                self._offers[version] = (sha256, blob_ref)
            return self._take_offers()

    def _take_offers(self) -> list[dict]:
        """Apply the offered deltas that follow the version held, in order (lock held)."""
        ray, reports = _ray(), []
        for v in [v for v in self._offers if v <= self.policy.version]:
            del self._offers[v]                   # overtaken by a full load
        while self.policy.version + 1 in self._offers:
            version = self.policy.version + 1
            sha256, blob_ref = self._offers.pop(version)
            try:
                patch = delta.prepare(self.policy.model.state_dict(), ray.get(blob_ref[0]))
            except delta.DeltaError as exc:
                log.warning("actor %d at v%s: %s", self.index, self.policy.version, exc)
                return reports + [{"index": self.index, "version": self.policy.version,
                                   "need_full": True}]
            if patch.sha256 != sha256:
                raise delta.DeltaError(f"delta to v{version} leads to {patch.sha256[:12]}, "
                                       f"expected {sha256[:12]}")
            self.policy.swap_state(patch.commit, version)
            reports.append(self._report())
        return reports

    def run_group(self, index: int) -> Group:
        """Run the group of task `index` (modulo the task list) on the weights held."""
        if not self._ready.wait(timeout=READY_TIMEOUT_S):
            raise TimeoutError(f"actor {self.index} got no weights in {READY_TIMEOUT_S:.0f} s")
        task = self.tasks[index % len(self.tasks)]
        return self.runner(self.policy, task, self.store, self.config.rollout,
                           self._stop.is_set)

    def stop(self) -> None:
        """Cut the group in flight short (the run is ending)."""
        self._stop.set()

    def pid(self) -> int:
        import os
        return os.getpid()


# -- the driver ---------------------------------------------------------------------------------

@dataclass
class Slot:
    """One worker's place: its bundle, the live actor and the task index it runs."""
    index: int
    actor: Any = None
    incarnation: int = 0
    task: int | None = None        # task index in flight
    deaths: int = 0                # since this slot last finished a group


class RayRollouts:
    """The actors of one `Pipeline.run` and the thread that keeps them busy."""

    def __init__(self, pipe: Any, q: queue.Queue):
        ray = _ray()
        from ray.util.placement_group import placement_group
        self.pipe, self.q, self.config = pipe, q, pipe.config
        rc = self.config.ray
        connect(rc)
        n = max(1, self.config.rollout.workers)
        self.pg = placement_group([{"CPU": rc.num_cpus}] * n, strategy=rc.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"the Ray cluster has no room for {n} rollout workers of "
                               f"{rc.num_cpus} CPUs each ({ray.cluster_resources()})")
        self._remote = ray.remote(RolloutActor)
        self._lock = threading.Lock()             # slots, pending, the latest version
        self.version = pipe.trainer.version
        self.state = pipe.trainer.published
        self.sha = {self.version: delta.state_sha256(self.state)}   # published version -> sha
        self._full: tuple[int, Any] | None = None  # (version, object ref of its full state)
        self.pending: dict[Any, tuple[str, Slot, Any]] = {}  # ref -> (kind, slot, actor)
        self.reports: list[dict] = []             # every weight report, in arrival order
        self.rerun: list[int] = []                # task indices run again after a death
        self.replaced = 0
        self.slots = [Slot(i) for i in range(n)]
        with self._lock:
            for slot in self.slots:
                self._spawn(slot)
        pipe.publish_hooks.append(self.publish)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="ray-rollouts")
        self.thread.start()

    # -- weights ------------------------------------------------------------------------------

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """(Trainer thread, after each step.) Put the delta to `version` in the object store
        once and offer it to every actor."""
        ray = _ray()
        if version == self.version:
            return                                # the step did not update the weights
        blob = delta.encode(self.state, state, from_version=self.version, to_version=version)
        sha = delta.read_header(blob)["target_sha256"]
        ref = ray.put(blob)
        with self._lock:
            self.sha[version], self.version, self.state = sha, version, state
            for slot in self.slots:
                self._track("weights", slot, slot.actor.offer.remote(version, sha, [ref]))

    def _full_ref(self) -> Any:
        """The object ref of the newest version's full state (put once, when first needed)."""
        if self._full is None or self._full[0] != self.version:
            self._full = (self.version, _ray().put(self.state))
        return self._full[1]

    def _send_full(self, slot: Slot) -> None:
        ref = slot.actor.load.remote(self.version, self.sha[self.version], [self._full_ref()])
        self._track("weights", slot, ref)

    def _check(self, report: dict, slot: Slot) -> None:
        expected = self.sha.get(report["version"])
        report = {**report, "incarnation": slot.incarnation}
        self.reports.append(report)
        if report["sha256"] != expected:
            raise RuntimeError(f"rollout actor {slot.index} holds {report['sha256'][:12]} as "
                               f"version {report['version']}, published {str(expected)[:12]}")

    # -- actors -------------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        """A new actor in `slot`'s bundle, sent the newest full state (lock held)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=slot.index)
        slot.actor = self._remote.options(
            num_cpus=self.config.ray.num_cpus, max_concurrency=8, scheduling_strategy=strategy,
            name=None).remote(self.config, str(self.pipe.model_path), str(self.pipe.store.home),
                              slot.index)
        slot.incarnation += 1
        self._send_full(slot)

    def _replace(self, slot: Slot, dead: Any, exc: BaseException) -> None:
        """`dead` (slot's actor) died of `exc`: a new actor takes its place (lock held)."""
        if slot.actor is not dead:
            return                                # already replaced
        slot.deaths += 1
        if slot.deaths > self.config.ray.max_replacements:
            raise RuntimeError(f"rollout actor {slot.index} died without finishing a group "
                               f"({slot.deaths} in a row): {exc}") from exc
        _ray().kill(dead, no_restart=True)
        self.replaced += 1
        log.warning("rollout actor %d died; starting a new one", slot.index)
        self._spawn(slot)

    def _track(self, kind: str, slot: Slot, ref: Any) -> None:
        self.pending[ref] = (kind, slot, slot.actor)

    def _submit(self, slot: Slot, task: int) -> None:
        slot.task = task
        self._track("group", slot, slot.actor.run_group.remote(task))

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        ray = _ray()
        pipe = self.pipe
        try:
            while not pipe._stop.is_set():
                with self._lock:
                    for slot in self.slots:
                        if slot.task is None and pipe._credits.acquire(blocking=False):
                            self._submit(slot, pipe._next_index())
                    refs = list(self.pending)
                if not refs:
                    time.sleep(0.05)
                    continue
                done, _ = ray.wait(refs, num_returns=1, timeout=0.1)
                for ref in done:
                    self._handle(ref)
        except BaseException as exc:              # surfaced by the trainer loop
            pipe._error = exc
            pipe._stop.set()

    def _handle(self, ref: Any) -> None:
        ray = _ray()
        from ray.exceptions import RayActorError
        with self._lock:
            kind, slot, actor = self.pending.pop(ref)
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            with self._lock:
                if kind == "group":
                    self._replace(slot, actor, exc)
                    self.rerun.append(slot.task)
                    self._submit(slot, slot.task)        # the same task, on the new actor
            return
        if kind == "weights":
            with self._lock:
                for report in result:
                    if not report.get("need_full"):
                        self._check(report, slot)
                    elif slot.actor is actor:
                        self._send_full(slot)
            return
        with self._lock:
            slot.task, slot.deaths = None, 0
        self.pipe._put(self.q, self.pipe._generated(result))

    def close(self) -> None:
        """Stop the loop, let the actors report the last weights, end them and free the
        placement group."""
        ray = _ray()
        from ray.util.placement_group import remove_placement_group
        self.pipe._stop.set()
        self.thread.join(timeout=30)
        with self._lock:
            for slot in self.slots:
                slot.actor.stop.remote()
            weights = {r: v for r, v in self.pending.items() if v[0] == "weights"}
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        try:
            while weights and time.monotonic() < deadline:
                done, _ = ray.wait(list(weights), num_returns=1, timeout=0.5)
                for ref in done:
                    _, slot, _ = weights.pop(ref)
                    try:
                        result = ray.get(ref)
                    except Exception:             # a dead actor, or a delta it refused
                        continue
                    for report in result:
                        if not report.get("need_full"):
                            self._check(report, slot)
        finally:
            if self.publish in self.pipe.publish_hooks:
                self.pipe.publish_hooks.remove(self.publish)
            for slot in self.slots:
                ray.kill(slot.actor, no_restart=True)
            remove_placement_group(self.pg)


def start_actors(pipe: Any, q: queue.Queue) -> Callable[[], None]:
    """Start the pipeline's rollout actors, feeding finished groups into `q`; returns the
    function that ends them. `pipe.backend` is the `RayRollouts` during and after the run."""
    pipe.backend = RayRollouts(pipe, q)
    return pipe.backend.close
