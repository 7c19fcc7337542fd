"""Pass@1 of recipe checkpoints on simulated tasks, with episodes spread over processes.

Each process loads its own copy of the checkpoint (on the GPU when there is one) and runs its
share of the tasks with `learner.rollout.run_episode`, `concurrency` episodes at a time on
threads whose model calls decode as one batch (`BatchingPolicy`), so a 16-core GPU machine
evaluates 200 tasks in a couple of minutes. Greedy decoding; one episode per task;
every model evaluated with the same `EvalConfig` sees the same tasks, built once and handed to
the processes. Processes are spawned (CUDA cannot fork), so a script calling `evaluate_model`
with more than one process needs the `if __name__ == "__main__":` guard.

It does not format reports for people (`learner.eval` does) and it does not train.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass
class EvalConfig:
    n: int = 200                    # held-out instances (families in turn)
    split: str = "heldout"          # "heldout" or "train"
    seed: int = 0                   # generate(split, n, seed)
    max_steps: int = 20             # model calls per episode
    max_new_tokens: int = 512       # tokens per model call
    processes: int = 0              # episode processes, each loads the model (0: cores - 2)
    device: str = "auto"            # "auto": cuda when available, else cpu
    threads: int = 1                # torch threads per process on CPU
    concurrency: int = 8            # episodes at once per process (their calls batch)
    max_seconds: float = 0.0        # a process starts no episode after this (0 = no limit);
                                    # tasks not run are left out of n
    families: list[str] | None = None  # only these task families (None: all, in turn)
    folder: str = ""                # a task folder, or a folder of them, instead of generated
                                    # tasks (its first n)
    sandbox: str | None = None      # "auto", "off", "require" (None: $APPRENTICE_SANDBOX, else auto)
    context_window: int = 0         # a smaller window than the model's (0: the model's own),
                                    # so long episodes summarize themselves
    summary_window: int = 0         # the recipe's eval stage also evaluates its last model with
                                    # this window (self-summarization check; 0: skip)
    constrain_calls: bool = True    # hold tool calls to their form (AgentConfig.constrain_calls)
    check_references: bool = False  # and what they name to the workspace (AgentConfig.
                                    # check_references)


def eval_tasks(config: EvalConfig) -> list:
    """The tasks `config` evaluates on, in order."""
    from learner.eval import resolve_tasks
    return resolve_tasks(config.folder or f"sim-{config.split}", config.n, seed=config.seed,
                         families=config.families)


def _shard(args: tuple) -> list[dict]:
    model_dir, tasks, config = args
    import time

    import torch

    from agent_runtime.policies.batching import BatchingPolicy
    from agent_runtime.policies.engine import EnginePolicy
    from agent_runtime.store import SessionStore
    from learner.recipe.pretrain import pick_device
    from agent_runtime.agent import AgentConfig
    from agent_runtime.names import ORIGIN_EVAL
    from learner.rollout import run_episode

    torch.set_num_threads(config.threads)
    device = pick_device(config.device)
    engine = EnginePolicy.load(str(model_dir), device=device, temperature=0.0, seed=0,
                               max_new_tokens=config.max_new_tokens)   # seed: the loop fallback
    if config.context_window:
        engine.context_window = min(config.context_window, engine.context_window)
    policy = BatchingPolicy(engine, max_batch=max(1, config.concurrency))
    deadline = time.monotonic() + config.max_seconds if config.max_seconds else None

    def one(task) -> dict | None:
        if deadline is not None and time.monotonic() > deadline:
            return None                        # not started: left out of n
        try:
            ep = run_episode(policy, task, store, sandbox=config.sandbox, origin=ORIGIN_EVAL,
                             agent_config=AgentConfig(max_steps=config.max_steps,
                                                      constrain_calls=config.constrain_calls,
                                                      check_references=config.check_references))
            return {"task": task.id, "family": task.family, "passed": ep.reward > 0,
                    "cheated": ep.cheated, "steps": ep.steps, "tokens": ep.tokens,
                    "status": ep.status}
        except Exception as exc:               # count it as failed, keep evaluating
            return {"task": task.id, "family": task.family, "passed": False,
                    "cheated": False, "steps": 0, "tokens": 0, "status": f"error: {exc}"}

    with tempfile.TemporaryDirectory(prefix="apprentice-eval-") as home:
        store = SessionStore(home)
        with ThreadPoolExecutor(max(1, config.concurrency)) as pool:
            rows = [r for r in pool.map(one, tasks) if r is not None]
        store.close()
    return rows


def shards(tasks: list, k: int) -> list[list]:
    """`tasks` in k parts for k processes. Tasks come families in turn, so every k-th task
    would give each process its own families when k divides their number, and the one with
    the long families would finish last (~1.5x the other's time with k = 2): the parts take
    turns over an order fixed by the task ids instead."""
    mixed = sorted(tasks, key=lambda t: hashlib.blake2b(t.id.encode(), digest_size=8).digest())
    return [mixed[i::k] for i in range(k)]


def evaluate_model(model_dir: Path, config: EvalConfig) -> dict:
    """pass@1, per-family pass rates and means over the tasks of `config` (`eval_tasks`).
    An episode passes when its reward is positive: passing tests reached by cheating do not."""
    tasks = eval_tasks(config)
    k = max(1, min(config.processes or (os.cpu_count() or 2) - 2, len(tasks), 14))
    chunks = [(str(model_dir), shard, config) for shard in shards(tasks, k)]
    if k == 1:
        parts = [_shard(chunks[0])]
    else:
        with ProcessPoolExecutor(k, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_shard, chunks))
    rows = sorted((r for p in parts for r in p), key=lambda r: r["task"])
    families: dict[str, list[int]] = {}
    for r in rows:
        families.setdefault(r["family"], [0, 0])
        families[r["family"]][0] += r["passed"]
        families[r["family"]][1] += 1
    n = len(rows) or 1
    return {"n": len(rows), "split": config.split, "tasks": config.folder or f"sim-{config.split}",
            "pass_at_1": sum(r["passed"] for r in rows) / n,
            "cheated": sum(r["cheated"] for r in rows),
            "mean_steps": sum(r["steps"] for r in rows) / n,
            "mean_tokens": sum(r["tokens"] for r in rows) / n,
            "by_family": {f: {"passed": a, "n": b} for f, (a, b) in sorted(families.items())},
            "episodes": rows}
