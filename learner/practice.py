"""Practice: the serving version's verified passes on simulated training tasks, mixed into a
learning cycle as positive samples.

    practice = Practice(model_path, state_dir, PracticeConfig(tasks=16))
    samples, stats = practice.samples(serving_version, serving_state, cycle_id)

Each cycle, the serving version runs `tasks` train-split simulated tasks (fresh ones every
cycle: `generate("train", tasks, seed=seed + cycle)`) at `temperature`, as `rollout`
sessions in a store of the learner's own (`$APPRENTICE_HOME/learner/practice/`, never the
user's), graded by their hidden tests. Every model call of a passing episode the grader did
not flag as cheating becomes a sample with advantage `advantage`; failed episodes give none.
This is self-imitation (Oh et al., 2018) or rejection-sampling fine-tuning (Yuan et al.,
2023): the verifiable-reward half of Cursor's loop (GRPO on simulated tasks beside online RL
from use), in the one form that needs no group per task, so it costs one episode per task.

Why it is in the cycle. User ratings say what the user likes about a session (a test run
before `finish`), not whether the task got done: an update made only of them drifts on
everything they do not mention. In bench/online.py's seventeenth run, all 8 rejected
candidates lost the same held-out gate task (a fix_import the serving version solves by
copying one import line), and the published ones lost 2 of 40 evaluation tasks while gaining
1 (`Gate` holds only the tasks it runs). The practice samples are the serving version's own
successful behaviour on tasks like those, so each cycle's update is also asked to keep doing
what solves tasks; InstructGPT mixes pre-training gradients into PPO for the same reason.
Only passes count: a failed episode's calls are mostly right and one is wrong, and without a
group there is no baseline to say which.

The samples carry the serving version and the temperature they were drawn at, like any
recorded sample, so the trainer's importance ratios and router replay treat them as it treats
the user's. They are not the user's data: they are not counted as liked, never consumed as
rated samples, and `logprob_shift` reports the user's samples only.

Not here: the cycle (`online.py`), the tasks (`learner.tasks`), grading (`learner.rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from learner.grpo import TrainSample, train_sample

PRACTICE_DIR = "practice"     # under the learner's state folder: the practice episodes' store


@dataclass
class PracticeConfig:
    tasks: int = 0                  # train-split simulated tasks per cycle (0: no practice)
    temperature: float = 1.0        # sampling, as the user's sessions are served
    advantage: float = 1.0          # each passing episode's calls' advantage (a liked sample's
                                    # is its reward minus the ratings' running mean, ~1.3 in
                                    # bench/online.py, where most ratings are thumbs down)
    max_steps: int = 12             # model calls per episode
    max_new_tokens: int = 512       # tokens per model call (as the gate's)
    concurrency: int = 4            # episodes at once (their calls decode as one batch)
    seed: int = 20_000              # the tasks of cycle c are generate("train", tasks, seed + c)
                                    # (bench/online.py rates seeds 0.. and probes 10,000)
    sandbox: str | None = None      # "auto" | "off" | "require"; None: $APPRENTICE_SANDBOX


@dataclass
class PracticeStats:
    tasks: int = 0                  # episodes run
    passed: int = 0                 # of them passed (and not flagged as cheating)
    samples: int = 0                # model calls of the passing episodes

    def to_json(self) -> dict:
        return {"tasks": self.tasks, "passed": self.passed, "samples": self.samples}


class Practice:
    """Runs one checkpoint's states on simulated training tasks; keeps the passes."""

    def __init__(self, model_path: str | Path, state_dir: str | Path,
                 config: PracticeConfig | None = None):
        self.model_path, self.state_dir = str(model_path), Path(state_dir)
        self.config = config or PracticeConfig()
        self._engine = self._policy = None

    def samples(self, version: int, state: Mapping[str, torch.Tensor], cycle: int
                ) -> tuple[list[TrainSample], PracticeStats]:
        """Practice samples of the state `state` (published as `version`) for cycle `cycle`."""
        c = self.config
        if c.tasks <= 0:
            return [], PracticeStats()
        from agent_runtime.agent import AgentConfig
        from agent_runtime.names import ORIGIN_ROLLOUT
        from agent_runtime.store import SessionStore
        from learner.rollout import run_episodes
        from learner.tasks import generate
        policy = self._load()
        self._engine.load_state(state, version)
        tasks = generate("train", c.tasks, seed=c.seed + cycle)
        with SessionStore(self.state_dir / PRACTICE_DIR) as store:
            episodes = run_episodes(lambda _t: policy, tasks, store, concurrency=c.concurrency,
                                    sandbox=c.sandbox, origin=ORIGIN_ROLLOUT,
                                    agent_config=AgentConfig(max_steps=c.max_steps))
            out = passing_samples(store, episodes, c.advantage)
        passed = sum(e.passed and not e.cheated for e in episodes)
        return out, PracticeStats(len(episodes), passed, len(out))

    def _load(self) -> Any:
        if self._policy is None:
            from agent_runtime.policies.batching import shared
            from agent_runtime.policies.engine import EnginePolicy
            self._engine = EnginePolicy.load(self.model_path, temperature=self.config.temperature,
                                             dtype="bfloat16",
                                             max_new_tokens=self.config.max_new_tokens)
            self._policy = shared(self._engine, self.config.concurrency)
        return self._policy


def honest_passes(store: Any, episodes: list[Any]) -> list[tuple[Any, list[dict]]]:
    """(episode, its recorded model calls with a completion) of each episode that passed and
    was not flagged as cheating."""
    return [(e, [s for s in store.samples(e.session_id) if s["completion_ids"]])
            for e in episodes if e.passed and not e.cheated]


def passing_samples(store: Any, episodes: list[Any], advantage: float) -> list[TrainSample]:
    """Every model call of the episodes that passed and were not flagged as cheating, as
    samples with `advantage` (calls with no completion skipped)."""
    return [train_sample(s, advantage, e.session_id)
            for e, samples in honest_passes(store, episodes) for s in samples]
