"""Agent episodes on the engine: prefix caching and batched decoding against the plain engine.

Every agent call renders the whole conversation again (system prompt, tool schemas, all turns
so far), so without a prefix cache each call prefills thousands of tokens to add a few
hundred. This runs real agent episodes (the loop, tools and store) on held-out simulated
tasks with the engine policy, greedy, and times the model calls:

  plain      one episode after another, prefix cache off        (the reference)
  cached     one episode after another, prefix cache on
  static     the same, but a running batch never gives way to waiting calls (they wait for
             its longest row: batching as it was before continuous batching)
  batched    all episodes at once on threads through a BatchingPolicy, prefix cache on
             (continuous batching: a batch pauses for calls that arrive while it decodes)

    python bench/agent_turns.py --model .recipe/default/sft/model
    python bench/agent_turns.py --model default --episodes 8 --steps 6 --tokens 128

`--model`: a checkpoint folder, "default" (the shipped model, else a random init of the
default shape; a random model rarely stops early, so its calls run to --tokens) or "test".
Each setting runs the same tasks; greedy outputs can differ slightly between settings
(reused keys were computed by decode steps, a fresh prefill computes them together), so the
tokens generated are printed next to the times. The last line is episodes per hour of
the batched setting over the plain one (and over the static one, when both ran).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delta import checkpoint  # noqa: E402


class Timed:
    """Counts a policy's calls, their seconds, prompt tokens and generated tokens."""

    def __init__(self, policy):
        self.policy, self.lock = policy, threading.Lock()
        self.calls = self.prompt_tokens = self.new_tokens = 0
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def complete(self, *args, **kw):
        t = time.perf_counter()
        c = self.policy.complete(*args, **kw)
        self._count([c], time.perf_counter() - t)
        return c

    def complete_many(self, *args, **kw):            # what a BatchingPolicy hands the engine
        t = time.perf_counter()
        out = self.policy.complete_many(*args, **kw)
        self._count(out, time.perf_counter() - t)
        return out

    def _count(self, completions, seconds: float) -> None:
        completions = [c for c in completions if c.finish_reason != "paused"]   # goes on later
        with self.lock:
            self.seconds += seconds
            self.calls += len(completions)
            self.prompt_tokens += sum(len(c.prompt_ids) for c in completions)
            self.new_tokens += sum(len(c.completion_ids) for c in completions)


def run_setting(name: str, path: Path, tasks: list, a, home: Path) -> dict:
    from agent_runtime.policies.batching import BatchingPolicy
    from agent_runtime.policies import load_policy
    from agent_runtime.store import SessionStore
    from learner.rollout import run_episodes

    policy = load_policy(str(path), temperature=0.0, max_new_tokens=a.tokens,
                         prefix_cache_mb=0 if name == "plain" else a.cache_mb)
    timed = Timed(policy)
    shared = None
    if name in ("batched", "static"):
        shared = BatchingPolicy(timed, max_batch=len(tasks),
                                yield_after_s=float("inf") if name == "static" else 0.05)
    with SessionStore(home / name) as store:
        t = time.perf_counter()
        eps = run_episodes(lambda _task: shared or timed, tasks, store,
                           concurrency=len(tasks) if shared else 1, max_steps=a.steps,
                           sandbox="off")
        wall = time.perf_counter() - t
    cache = policy.prefix_cache
    return {"setting": name, "wall_s": wall, "episodes": len(eps),
            "calls": timed.calls, "model_s": timed.seconds,
            "prompt_tokens": timed.prompt_tokens, "new_tokens": timed.new_tokens,
            "reused_tokens": cache.reused_tokens,
            "batches": shared.stats.batches if shared else timed.calls,
            "pauses": shared.stats.pauses if shared else 0,
            "passed": sum(e.passed for e in eps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--episodes", type=int, default=8, help="held-out tasks (one episode each)")
    ap.add_argument("--steps", type=int, default=6, help="model calls per episode at most")
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per call")
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--settings", default="plain,cached,static,batched")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from learner import tasks as sim
    with tempfile.TemporaryDirectory() as tmp:
        path, label = checkpoint(a.model, Path(tmp))
        tasks = sim.generate("heldout", a.episodes, seed=0)
        print(f"model: {label}; {a.episodes} held-out tasks, <= {a.steps} calls of <= "
              f"{a.tokens} tokens each, greedy; torch threads {torch.get_num_threads()}, "
              f"cpus {os.cpu_count()}")
        rows = [run_setting(s, path, tasks, a, Path(tmp)) for s in a.settings.split(",")]
    print(f"{'setting':>8} {'wall s':>7} {'calls':>5} {'model s':>7} {'s/call':>6} "
          f"{'prompt tok/call':>15} {'reused':>6} {'new tok':>7} {'batches':>7} {'pauses':>6} "
          f"{'passed':>6}")
    for r in rows:
        print(f"{r['setting']:>8} {r['wall_s']:7.1f} {r['calls']:5d} {r['model_s']:7.1f} "
              f"{r['model_s'] / max(r['calls'], 1):6.2f} "
              f"{r['prompt_tokens'] / max(r['calls'], 1):15.0f} "
              f"{r['reused_tokens'] / max(r['prompt_tokens'], 1):6.0%} {r['new_tokens']:7d} "
              f"{r['batches']:7d} {r['pauses']:6d} {r['passed']:6d}")
    by = {r["setting"]: r for r in rows}
    if "plain" in by:
        for name in ("cached", "static", "batched"):
            if name in by:
                print(f"{name} / plain: {by['plain']['wall_s'] / by[name]['wall_s']:.2f}x "
                      f"episodes per hour")
    if "static" in by and "batched" in by:
        print(f"batched (continuous) / static: "
              f"{by['static']['wall_s'] / by['batched']['wall_s']:.2f}x episodes per hour")


if __name__ == "__main__":
    main()
