"""The toy task family: one model call, any answer, reward = share of the completion's tokens
whose text starts with a letter of the first half of the alphabet (a-m, after any spaces).
Trivially learnable by a tiny random model in a few GRPO steps, for tests and benchmarks of
the pipeline (`apprentice learn grpo --tasks toy`). The reward is a property of the pieces of
text the model chose, not of how a tokenizer happens to number them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from agent_runtime import names
from agent_runtime.names import ORIGIN_ROLLOUT
from agent_runtime.policies.base import batches
from learner.config import RolloutConfig
from learner.grpo import Episode, Group


@dataclass
class ToyTask:
    """One-call task: any answer; reward = `toy_reward` of its tokens' text."""
    id: str
    prompt: str


def toy_tasks(n: int, seed: int = 0) -> list[ToyTask]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "calc", "tests", "fix", "add", "sum", "list"]
    return [ToyTask(f"toy-{seed}-{i}", f"Say something about {' '.join(rng.sample(words, 3))}.")
            for i in range(n)]


def toy_reward(pieces: list[str]) -> float:
    """Share of `pieces` (the completion's tokens as text) that start with a letter a-m, any
    case, after leading spaces; 0 for no pieces."""
    heads = [p.lstrip()[:1].lower() for p in pieces]
    return sum("a" <= h <= "m" for h in heads) / len(heads) if heads else 0.0


def token_pieces(tokenizer: Any, completion_ids: list[int], stop_ids: list[int]) -> list[str]:
    """The completion's tokens as text, its stop tokens left out."""
    stop = set(stop_ids)
    return [tokenizer.decode([t]) for t in completion_ids if t not in stop]


def run_toy_group(policy: Any, task: ToyTask, store: Any, config: RolloutConfig,
                  should_stop: Callable[[], bool] = lambda: False) -> Group:
    episodes, samples = [], []
    messages = [{"role": "user", "content": task.prompt}]
    G = config.group_size
    if batches(policy):                             # the whole group in one batch
        done = policy.complete_many([messages] * G, max_new_tokens=config.max_new_tokens,
                                    should_stop=[should_stop] * G)
    else:
        done = [policy.complete(messages, max_new_tokens=config.max_new_tokens,
                                should_stop=should_stop) for _ in range(G)]
    with store.transaction():                      # the group is recorded whole or not at all
        for c in done:
            sid = store.create_session(task.prompt, "", policy.name, c.version,
                                       meta={"family": "toy", "task_id": task.id},
                                       origin=ORIGIN_ROLLOUT)
            store.add_message(sid, 0, "user", task.prompt)
            mid = store.add_message(sid, 0, "assistant", c.text)
            store.add_sample(sid, 0, mid, c.prompt_ids, c.completion_ids, c.logprobs, c.routes,
                             c.version, c.finish_reason, c.temperature)
            reward = toy_reward(token_pieces(policy.tokenizer, c.completion_ids,
                                             policy.stop_token_ids))
            store.set_status(sid, names.FINISHED, summary=f"reward {reward:.3f}")
            episodes.append(Episode(sid, reward, passed=reward > 0.5))
    samples = [store.samples(e.session_id) for e in episodes]
    return Group(task.id, episodes, samples)
