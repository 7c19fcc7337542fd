"""Held-out evaluation: pass@1, mean steps and mean tokens of a policy over a task set.

A task set is simulated (`sim-heldout`, `sim-train`: `n` generated instances) or a folder
(one task folder, or a folder of task folders). Every episode is a real rollout
(`learner.rollout`), recorded in the store like any session. `--policy oracle` runs the
scripted solver (generated tasks only), which should score 100 %. This module formats the
report; `apprentice eval` is a thin command over `evaluate` and `format_report`.

`apprentice eval --compare sft,default` evaluates several checkpoints on the same tasks with
`learner.recipe.evaluate.evaluate_model` (episodes over processes); this module names the
models (`resolve_model`) and prints their pass@1 side by side (`format_comparison`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from agent_runtime.names import ORIGIN_EVAL
from learner.rollout import Episode, run_episodes
from learner.tasks import TaskInstance, generate, load_tasks

SIM_SETS = {"sim-heldout": "heldout", "sim-train": "train"}
MODEL_STAGES = ("pretrain", "sft", "rft", "grpo")   # recipe stages that write `<stage>/model`,
                                                    # in recipe order


@dataclass
class EvalReport:
    episodes: list[Episode]
    samples: int = 1                    # episodes per task (sampled: `evaluate(samples=...)`)

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
        """family -> (solved, total) episodes."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.episodes:
            k, n = out.get(e.family, (0, 0))
            out[e.family] = (k + (e.reward > 0), n + 1)
        return dict(sorted(out.items()))

    def tasks_solved(self) -> dict[str, tuple[int, int]]:
        """family -> (tasks with at least one solved episode, tasks): pass@`samples`."""
        solved: dict[str, dict[str, bool]] = {}
        for e in self.episodes:
            tasks = solved.setdefault(e.family, {})
            tasks[e.task_id] = tasks.get(e.task_id, False) or e.reward > 0
        return {f: (sum(t.values()), len(t)) for f, t in sorted(solved.items())}

    @property
    def pass_at_k(self) -> float:
        """The share of tasks solved by at least one of their `samples` episodes."""
        counts = self.tasks_solved().values()
        tasks = sum(n for _, n in counts)
        return sum(k for k, _ in counts) / tasks if tasks else 0.0

    def to_dict(self) -> dict:
        """The numbers and every episode, for `--json`."""
        out = {"n": self.n, "solved": self.solved, "pass_at_1": self.pass_at_1,
               "mean_steps": self.mean_steps, "mean_tokens": self.mean_tokens,
               "cheated": self.cheated,
               "by_family": {f: {"passed": k, "n": n} for f, (k, n) in self.by_family().items()}}
        if self.samples > 1:
            out |= {"samples": self.samples, "pass_at_k": self.pass_at_k,
                    "tasks_solved": {f: {"solved": k, "tasks": n}
                                     for f, (k, n) in self.tasks_solved().items()}}
        return out | {"episodes": [asdict(e) for e in self.episodes]}


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


def policy_factory(spec: str, max_new_tokens: int = 512, context_window: int = 0,
                   temperature: float = 0.0, quantize: str | None = None
                   ) -> Callable[[TaskInstance], Any]:
    """What makes each episode's policy: `oracle` (one per task), `replay:FILE` (a fresh
    replay per task), anything else a model loaded once and shared (greedy unless
    `temperature` > 0, at most `max_new_tokens` per call, as `learner.recipe.evaluate` runs
    it) through a `BatchingPolicy`, so episodes running at once decode together.
    `context_window` (when set) makes a model's window smaller, so self-summarization starts
    earlier. `quantize` ("int8"): the model decodes with int8 copies of its weights."""
    if quantize and (spec == "oracle" or spec.startswith("replay:")):
        raise ValueError("--quantize needs a model")
    if spec == "oracle":
        from learner.tasks.oracle import OraclePolicy
        return OraclePolicy
    from agent_runtime.policies import load_policy
    if spec.startswith("replay:"):
        return lambda task: load_policy(spec)
    from agent_runtime.policies.batching import BatchingPolicy
    # greedy: seed 0 makes the loop fallback's resampling reproducible; sampled: a fresh seed
    # per call, or the samples of one task would repeat one another
    model = load_policy(spec, temperature=temperature, max_new_tokens=max_new_tokens,
                        seed=0 if temperature == 0 else None, quantize=quantize)
    if context_window:
        model.context_window = min(context_window, model.context_window)
    policy = BatchingPolicy(model)
    return lambda task: policy


def evaluate(tasks: list[TaskInstance], factory: Callable[[TaskInstance], Any], store, *,
             concurrency: int = 1, max_steps: int = 20, sandbox=None,
             constrain_calls: bool = True, check_references: bool = False,
             samples: int = 1,
             on_episode: Callable[[Episode], None] | None = None,
             still_clock: bool = True) -> EvalReport:
    """Run `samples` episodes per task (one each by default; more only make sense with a
    sampling policy) and collect the report. `constrain_calls=False` lets the model write
    tool calls that cannot run (`AgentConfig.constrain_calls`), `check_references=True` holds
    what they name to the workspace too (`AgentConfig.check_references`); `on_episode` sees each
    episode as it finishes. `still_clock`: pytest in the tasks' commands reports every
    duration as 0 (`grading.fixed_clock`), so an evaluation of a greedy policy repeats
    itself exactly; False: the real durations."""
    from agent_runtime.agent import AgentConfig
    from agent_runtime.sandbox import SandboxConfig
    from learner.tasks.grading import as_sandbox_config, fixed_clock
    if still_clock:          # None is the default config, as in `run_episode`
        sandbox = fixed_clock(as_sandbox_config(sandbox, SandboxConfig()))
    episodes = run_episodes(factory, [t for t in tasks for _ in range(samples)], store,
                            concurrency=concurrency, sandbox=sandbox,
                            agent_config=AgentConfig(max_steps=max_steps,
                                                     constrain_calls=constrain_calls,
                                                     check_references=check_references),
                            origin=ORIGIN_EVAL, on_episode=on_episode)
    return EvalReport(episodes, samples)


def episode_line(e: Episode) -> str:
    mark = "PASS" if e.reward > 0 else ("CHEAT" if e.cheated else "FAIL")
    return (f"{mark:<5} {e.task_id:<34} steps {e.steps:>2}  tokens {e.tokens:>6}  "
            f"{e.session_id[:12]}  {e.detail}")


def format_report(report: EvalReport, verbose: bool = False) -> str:
    lines = [episode_line(e) for e in report.episodes] if verbose else []
    k = report.samples
    tasks = report.tasks_solved() if k > 1 else {}
    if verbose and len(report.by_family()) > 1:
        lines += [f"  {family:<20} {s}/{n}" + (f"  pass@{k} {tasks[family][0]}/{tasks[family][1]}"
                                               if k > 1 else "")
                  for family, (s, n) in report.by_family().items()]
    summary = (f"pass@1 {100 * report.pass_at_1:.1f}% ({report.solved}/{report.n})  "
               f"mean steps {report.mean_steps:.1f}  mean tokens {report.mean_tokens:.0f}")
    if report.cheated:
        summary += f"  cheated {report.cheated}"
    if k > 1:
        solved, total = (sum(c) for c in zip(*tasks.values()))
        summary += f"  pass@{k} {100 * solved / total:.1f}% ({solved}/{total} tasks)"
    return "\n".join(lines + [summary])


# -- several models on the same tasks ---------------------------------------------------------

def resolve_model(spec: str, recipe_dir: Path) -> Path:
    """A checkpoint directory from `default` (the shipped model), a recipe stage name
    (`recipe_dir/<stage>/model`) or a checkpoint path. Raises FileNotFoundError saying what
    was tried."""
    from agent_runtime.policies import resolve_model_path
    if spec == "default":
        try:
            return resolve_model_path("default")
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"'default': {str(exc).split('. ')[0]}; set $APPRENTICE_DEFAULT_MODEL, or name "
                f"a recipe stage ({', '.join(MODEL_STAGES)}) or a checkpoint directory") from None
    tried = [recipe_dir / spec / "model"] if spec in MODEL_STAGES else []
    tried.append(Path(spec).expanduser())
    for path in tried:
        if (path / "config.json").is_file():
            return path
    raise FileNotFoundError(
        f"{spec!r} is not a model: tried {' and '.join(str(p) for p in tried)} (no config.json); "
        f"name 'default', a recipe stage ({', '.join(MODEL_STAGES)}, under --recipe "
        f"{recipe_dir}) or a checkpoint directory")


def _cell(passed: int, n: int) -> str:
    return f"{100 * passed / n:.1f}% ({passed}/{n})" if n else "-"


def _task_marks(results: dict[str, dict]) -> list[list[str]]:
    """One row per task: its id, then PASS / FAIL / CHEAT (or - if not run) per model."""
    marks: dict[str, list[str]] = {}
    for i, r in enumerate(results.values()):
        for e in r["episodes"]:
            mark = "PASS" if e["passed"] else ("CHEAT" if e.get("cheated") else "FAIL")
            marks.setdefault(e["task"], ["-"] * len(results))[i] = mark
    return [[task, *marks[task]] for task in sorted(marks)]


def format_comparison(results: dict[str, dict], verbose: bool = False) -> str:
    """pass@1 of each model (`evaluate_model` results, by name) per family and overall, one
    column per model, then each later model's difference to the first in points. `verbose`
    puts one row per task above the table."""
    names = list(results)
    families = sorted({f for r in results.values() for f in r["by_family"]})
    rows = [[f] + [_cell(**results[m]["by_family"].get(f, {"passed": 0, "n": 0}))
                   for m in names] for f in families]
    rows.append(["overall"] + [_cell(sum(e["passed"] for e in results[m]["episodes"]),
                                     results[m]["n"]) for m in names])
    if any(r.get("cheated") for r in results.values()):
        rows.append(["cheated"] + [str(results[m].get("cheated", 0)) for m in names])
    if verbose:
        rows = _task_marks(results) + [[""] * (len(names) + 1)] + rows
    rows.insert(0, ["pass@1"] + names)
    width = [max(len(c) for c in col) for col in zip(*rows)]
    lines = ["  ".join([row[0].ljust(width[0])] + [c.rjust(w) for c, w in zip(row[1:], width[1:])])
             .rstrip() for row in rows]
    base = results[names[0]]["pass_at_1"]
    lines += [f"{m} − {names[0]}: {100 * (results[m]['pass_at_1'] - base):+.1f} points"
              for m in names[1:]]
    return "\n".join(lines)
