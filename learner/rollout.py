"""Rollouts: real agent runs on tasks, in fresh workspaces and real sandboxes, graded.

`run_episode` materializes a task into a new temporary workspace, runs the `Agent` loop on its
instruction with the normal tools (the session, its samples with token ids, behaviour
logprobs, routes and policy version land in the store like any session), grades the finished
workspace with the hidden tests (`learner.tasks.grade`) and records the reward, with the
cheating flag and the reasons, in the store's `rewards` table. `run_episodes` runs many at
once on threads, each in its own workspace and sandbox.

Commands run through `agent_runtime.sandbox.Sandbox`: bubblewrap when it works ("auto"),
unsandboxed when asked ("off"); bubblewrap is probed once per process (`make_sandbox`), so a
machine without it warns once, not per episode. This module computes no advantages and trains
nothing; the GRPO trainer consumes the `Episode`s and the stored samples.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from agent_runtime.agent import Agent, AgentConfig, Callbacks, ToolOutcome
from agent_runtime.names import ORIGIN_ROLLOUT
from learner.sentiment import CHECK_COMMAND
from learner.tasks import TaskInstance, grade
from learner.tasks.grading import Grade, make_sandbox, sandbox_config


@dataclass
class Episode:
    task_id: str
    session_id: str
    reward: float
    passed: bool
    cheated: bool
    steps: int                                 # model calls
    tokens: int                                # completion tokens the policy generated
    status: str                                # the session's status: finished, failed ...
    family: str = ""
    split: str = ""
    detail: str = ""                           # the grade's one-line reason
    duration_s: float = 0.0                    # agent run and grading
    workspace: str | None = None               # kept only with keep_workspace=True
    tests_share: float | None = None           # share of the tests run that passed (`Grade`)


class FailedChecks:
    """An episode's failed checks after its first change, as its tool calls end
    (`Callbacks.on_tool_end`): a check is a command that runs code or tests
    (`learner.sentiment.CHECK_COMMAND`, what the session signals count as one; a command
    that only looks, `grep` or `ls`, may fail for the answer it gives), failed when its exit
    code is not 0 or it timed out; a change is a successful call of any other tool that
    mutates (an edit, a write). Commands that fail before the first change are the task's own
    failures being looked at, not counted. `reached()` turns true at `limit` failed checks
    (never with `limit` 0)."""

    def __init__(self, limit: int, mutating: set[str]):
        self.limit, self.mutating = limit, mutating
        self.changed = False
        self.failed = 0

    def __call__(self, call: Any, outcome: ToolOutcome) -> None:
        data = outcome.data or {}
        if "exit_code" in data or "timed_out" in data:
            command = str((call.arguments or {}).get("command", "")).strip()
            if self.changed and CHECK_COMMAND.search(command) and (
                    data.get("timed_out") or data.get("exit_code") not in (0, None)):
                self.failed += 1
        elif outcome.ok and call.name in self.mutating:
            self.changed = True

    def reached(self) -> bool:
        return 0 < self.limit <= self.failed


def run_episode(policy, task: TaskInstance, store, *, workdir: Path | None = None,
                max_steps: int = 20, sandbox=None, agent_config: AgentConfig | None = None,
                tools: list | None = None, keep_workspace: bool = False,
                origin: str = ORIGIN_ROLLOUT,
                should_stop: Callable[[], bool] | None = None,
                stop_after_failed_checks: int = 0) -> Episode:
    """One graded agent run of `policy` on `task`; the reward is recorded in `store`.

    The session is marked with `origin` ("rollout", or "eval" for evaluations): never
    learned from as user data, and hidden from `apprentice sessions list`.
    `sandbox`: a `SandboxConfig` or a mode ("auto", "off", "require"); None is the default
    config ($APPRENTICE_SANDBOX, else "auto"). `agent_config` overrides `max_steps`.
    `workdir`: where the temporary workspace is made (default: the system's temp folder).
    `should_stop`: once it turns true the episode ends at its next check (inside a model
    call, between tool calls: the agent's cancel, status "cancelled"); the workspace is
    graded as it was left. `stop_after_failed_checks` > 0 ends it the same way at that many
    failed checks after its first change (`FailedChecks`; `RolloutConfig.
    stop_after_failed_checks`)."""
    from agent_runtime.sandbox import SandboxConfig
    start = time.monotonic()
    config = sandbox_config(task, sandbox if sandbox is not None else SandboxConfig())
    root = Path(tempfile.mkdtemp(prefix="apprentice-rollout-", dir=workdir))
    workspace = root / "workspace"
    task.materialize(workspace)
    tokens = 0

    def count(_sample_id: int, completion) -> None:
        nonlocal tokens
        tokens += len(completion.completion_ids)

    box = make_sandbox(workspace, config)
    try:
        if tools is None:
            from agent_runtime.tools.registry import default_tools
            tools = default_tools()
        checks = FailedChecks(stop_after_failed_checks, {t.name for t in tools if t.mutates})
        stop = should_stop
        if stop_after_failed_checks > 0:
            stop = lambda: checks.reached() or (should_stop is not None and should_stop())
        agent = Agent(policy, tools=tools, store=store, workspace=workspace,
                      config=replace(agent_config or AgentConfig(max_steps=max_steps),
                                     origin=origin),
                      callbacks=Callbacks(on_sample=count, on_tool_end=checks), sandbox=box,
                      should_stop=stop)
        result = agent.run(task.instruction)
        graded = grade(task, workspace, sandbox=config,
                       transcript=store.tool_calls(result.session_id))
        record_reward(store, result.session_id, task, graded)
    finally:
        box.close()
        if not keep_workspace:
            shutil.rmtree(root, ignore_errors=True)
    return Episode(task.id, result.session_id, graded.reward, graded.passed, graded.cheated,
                   result.steps, tokens, result.status, task.family, task.split, graded.detail,
                   time.monotonic() - start, str(workspace) if keep_workspace else None,
                   graded.share)


def run_episodes(policy_factory: Callable[[TaskInstance], Any], tasks: list[TaskInstance],
                 store, *, concurrency: int = 4,
                 on_episode: Callable[[Episode], None] | None = None,
                 **kwargs: Any) -> list[Episode]:
    """`run_episode(policy_factory(task), task, store, **kwargs)` for every task, up to
    `concurrency` at a time on threads; episodes come back in the order of `tasks`, and
    each is passed to `on_episode` as it finishes (progress). A factory may return one
    shared policy if that policy is safe to call from threads."""
    def one(task: TaskInstance) -> Episode:
        episode = run_episode(policy_factory(task), task, store, **kwargs)
        if on_episode is not None:
            on_episode(episode)
        return episode

    if concurrency <= 1:
        return [one(t) for t in tasks]
    with ThreadPoolExecutor(concurrency, thread_name_prefix="rollout") as pool:
        return list(pool.map(one, tasks))


# ---------------------------------------------------------------- the rewards table

def record_reward(store, session_id: str, task: TaskInstance, graded: Grade) -> int:
    """Add the grade of `session_id` to the store's `rewards` table; returns the row id."""
    meta = {"violations": graded.violations, "exit_code": graded.exit_code,
            "grade_s": round(graded.duration_s, 3), "difficulty": task.difficulty,
            "tests": list(graded.tests) if graded.tests else None}
    return store.add_reward(session_id, task.id, graded.reward, graded.passed,
                            family=task.family, split=task.split, cheated=graded.cheated,
                            detail=graded.detail, meta=meta)


def rewards(store, session_id: str | None = None) -> list[dict]:
    """Recorded rewards (all, or one session's), oldest first (`SessionStore.rewards`)."""
    return store.rewards(session_id)
