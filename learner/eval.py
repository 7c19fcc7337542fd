"""Held-out evaluation: pass@1, mean steps and mean tokens of a policy over a task set.

A task set is simulated (`sim-heldout`, `sim-train`: `n` generated instances) or a folder
(one task folder, or a folder of task folders). Every episode is a real rollout
(`learner.rollout`), recorded in the store like any session. `--policy oracle` runs the
scripted solver (generated tasks only), which should score 100 %. This module formats the
report; `apprentice eval` is a thin command over `evaluate` and `format_report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from learner.rollout import Episode, run_episodes
from learner.tasks import TaskInstance, generate, load_tasks

SIM_SETS = {"sim-heldout": "heldout", "sim-train": "train"}


@dataclass
class EvalReport:
    episodes: list[Episode]

    @property
    def n(self) -> int:
        return len(self.episodes)

    @property
    def solved(self) -> int:
        return sum(e.reward > 0 for e in self.episodes)

    @property
    def pass_at_1(self) -> float:
        return self.solved / self.n if self.n else 0.0

    @property
    def mean_steps(self) -> float:
        return sum(e.steps for e in self.episodes) / self.n if self.n else 0.0

    @property
    def mean_tokens(self) -> float:
        return sum(e.tokens for e in self.episodes) / self.n if self.n else 0.0

    @property
    def cheated(self) -> int:
        return sum(e.cheated for e in self.episodes)

    def by_family(self) -> dict[str, tuple[int, int]]:
        """family -> (solved, total)."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.episodes:
            k, n = out.get(e.family, (0, 0))
            out[e.family] = (k + (e.reward > 0), n + 1)
        return dict(sorted(out.items()))


def resolve_tasks(spec: str, n: int | None = None, seed: int = 0,
                  families: list[str] | None = None) -> list[TaskInstance]:
    """`sim-heldout` / `sim-train` (`n` generated instances, default 50) or a folder path
    (all its tasks, or the first `n`)."""
    if spec in SIM_SETS:
        return generate(SIM_SETS[spec], 50 if n is None else n, seed=seed, families=families)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"--tasks must be {' or '.join(SIM_SETS)} or a task folder; "
                         f"{spec!r} is neither")
    tasks = load_tasks(path)
    return tasks if n is None else tasks[:n]


def policy_factory(spec: str) -> Callable[[TaskInstance], Any]:
    """What makes each episode's policy: `oracle` (one per task), `replay:FILE` (a fresh
    replay per task), anything else a model loaded once and shared."""
    if spec == "oracle":
        from learner.tasks.oracle import OraclePolicy
        return OraclePolicy
    from agent_runtime.policy import load_policy
    if spec.startswith("replay:"):
        return lambda task: load_policy(spec)
    policy = load_policy(spec)
    return lambda task: policy


def evaluate(tasks: list[TaskInstance], factory: Callable[[TaskInstance], Any], store, *,
             concurrency: int = 1, max_steps: int = 20, sandbox=None) -> EvalReport:
    """Run one episode per task and collect the report."""
    episodes = run_episodes(factory, tasks, store, concurrency=concurrency,
                            max_steps=max_steps, sandbox=sandbox)
    return EvalReport(episodes)


def episode_line(e: Episode) -> str:
    mark = "PASS" if e.reward > 0 else ("CHEAT" if e.cheated else "FAIL")
    return (f"{mark:<5} {e.task_id:<34} steps {e.steps:>2}  tokens {e.tokens:>6}  "
            f"{e.session_id[:12]}  {e.detail}")


def format_report(report: EvalReport, verbose: bool = False) -> str:
    lines = [episode_line(e) for e in report.episodes] if verbose else []
    if verbose and len(report.by_family()) > 1:
        lines += [f"  {family:<20} {k}/{n}" for family, (k, n) in report.by_family().items()]
    summary = (f"pass@1 {100 * report.pass_at_1:.1f}% ({report.solved}/{report.n})  "
               f"mean steps {report.mean_steps:.1f}  mean tokens {report.mean_tokens:.0f}")
    if report.cheated:
        summary += f"  cheated {report.cheated}"
    return "\n".join(lines + [summary])
