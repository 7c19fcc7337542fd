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
                 decay: float = 0.9):
        if not families:
            raise ValueError("a curriculum needs at least one task")
        self.floor, self.decay = floor, decay
        self.indices: dict[str, list[int]] = {}
        for i, family in enumerate(families):
            self.indices.setdefault(family, []).append(i)
        self.stats = {f: FamilyStats() for f in self.indices}
        self.cursors = {f: 0 for f in self.indices}
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
        tasks = self.indices[family]
        self.cursors[family] += 1
        return tasks[(self.cursors[family] - 1) % len(tasks)]

    def record(self, family: str, passed: list[bool]) -> None:
        """A finished group of `family`: its episodes' pass/fail."""
        if family not in self.stats:
            return
        s = self.stats[family]
        s.passes = self.decay * s.passes + sum(passed)
        s.episodes = self.decay * s.episodes + len(passed)

    def state(self) -> dict:
        return {"draws": self.draws, "cursors": dict(self.cursors),
                "stats": {f: [s.passes, s.episodes] for f, s in self.stats.items()}}

    def load_state(self, state: dict) -> None:
        self.draws = int(state["draws"])
        self.cursors.update({f: int(c) for f, c in state["cursors"].items() if f in self.cursors})
        for f, (passes, episodes) in state["stats"].items():
            if f in self.stats:
                self.stats[f] = FamilyStats(float(passes), float(episodes))
