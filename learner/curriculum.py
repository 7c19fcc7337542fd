"""Which training task a GRPO group runs next: where the policy both passes and fails.

A group whose episodes all pass or all fail has zero advantage everywhere and trains nothing,
yet its rollouts cost as much as any other; on a CPU they are most of a step's time. A small
policy passes some task families most of the time and others never (the default model:
`fix_command` ~80 %, `add_feature` 0 %), so drawing tasks in a fixed order wastes most groups.
`FamilyCurriculum` keeps a running pass rate per family from the groups the trainer has seen
and draws the next family with probability proportional to p(1 - p) + `floor` (the variance of
one episode's pass, which is what gives a group signal; the floor keeps every family sampled,
so a family the policy starts to solve is noticed). Within a family, tasks come in order.

    curriculum = FamilyCurriculum([t.family for t in tasks], seed=0)
    index = curriculum.next_index()            # into `tasks`
    curriculum.record(tasks[index].family, [True, False, ...])     # a finished group

With `revisit` > 0, a task whose last group was mixed (some episodes passed, some failed) is
kept in its family's pool, and a draw of that family takes a pooled task with probability
`revisit` instead of the next new one: within a family, outcomes are mostly a property of the
task (on the default model ~60 % of GRPO groups came back all-pass or all-fail), so a task
that was mixed once is the likeliest to give signal again, until the policy settles it (an
all-pass or all-fail group takes it out of the pool). Pass the task's index to `record`.

Counts decay by `decay` per recorded group of that family, so the estimate follows a policy
that changes; the prior is one pass and one failure. `state()` / `load_state()` make it part
of a training checkpoint, so a resumed run draws as the uninterrupted one would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class FamilyStats:
    passes: float = 0.0
    episodes: float = 0.0

    @property
    def pass_rate(self) -> float:
        return (self.passes + 1.0) / (self.episodes + 2.0)


class FamilyCurriculum:
    def __init__(self, families: list[str], seed: int = 0, floor: float = 0.02,
                 decay: float = 0.9, revisit: float = 0.0, pool: int = 32):
        if not families:
            raise ValueError("a curriculum needs at least one task")
        if not 0.0 <= revisit <= 1.0:
            raise ValueError(f"revisit is a probability, got {revisit}")
        self.floor, self.decay, self.revisit, self.pool_size = floor, decay, revisit, pool
        self.family_of = list(families)
        self.indices: dict[str, list[int]] = {}
        for i, family in enumerate(families):
            self.indices.setdefault(family, []).append(i)
        self.stats = {f: FamilyStats() for f in self.indices}
        self.cursors = {f: 0 for f in self.indices}
        self.pools: dict[str, list[int]] = {f: [] for f in self.indices}  # mixed last time
        self.draws = 0
        self.seed = seed

    def weights(self) -> dict[str, float]:
        """Each family's probability of being drawn next."""
        raw = {f: s.pass_rate * (1.0 - s.pass_rate) + self.floor for f, s in self.stats.items()}
        total = sum(raw.values())
        return {f: w / total for f, w in raw.items()}

    def next_index(self) -> int:
        """The index (into the task list given at construction) of the next task to run."""
        rng = random.Random(f"{self.seed}:{self.draws}")     # reproducible from `draws` alone
        self.draws += 1
        weights = self.weights()
        family = rng.choices(list(weights), list(weights.values()))[0]
        pool = self.pools[family]
        if pool and rng.random() < self.revisit:
            return rng.choice(pool)
        tasks = self.indices[family]
        self.cursors[family] += 1
        return tasks[(self.cursors[family] - 1) % len(tasks)]

    def record(self, family: str, passed: list[bool], index: int | None = None) -> None:
        """A finished group of `family` (of task `index`, when known): its episodes'
        pass/fail."""
        if family not in self.stats:
            return
        s = self.stats[family]
        s.passes = self.decay * s.passes + sum(passed)
        s.episodes = self.decay * s.episodes + len(passed)
        if index is None or not self.revisit or self.family_of[index] != family:
            return
        pool = self.pools[family]
        if index in pool:
            pool.remove(index)
        if 0 < sum(passed) < len(passed):           # mixed: the newest at the end
            pool.append(index)
            del pool[:-self.pool_size]

    def state(self) -> dict:
        return {"draws": self.draws, "cursors": dict(self.cursors),
                "pools": {f: list(p) for f, p in self.pools.items()},
                "stats": {f: [s.passes, s.episodes] for f, s in self.stats.items()}}

    def load_state(self, state: dict) -> None:
        self.draws = int(state["draws"])
        self.cursors.update({f: int(c) for f, c in state["cursors"].items() if f in self.cursors})
        self.pools.update({f: [int(i) for i in p] for f, p in state.get("pools", {}).items()
                           if f in self.pools})
        for f, (passes, episodes) in state["stats"].items():
            if f in self.stats:
                self.stats[f] = FamilyStats(float(passes), float(episodes))
