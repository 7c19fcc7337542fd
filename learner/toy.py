"""The toy task family: one model call, any answer, reward = share of even token ids among
the completion's text tokens. Trivially learnable by a tiny random model in a few GRPO steps,
for tests and benchmarks of the pipeline (`apprentice learn grpo --tasks toy`). The reward is
a property of the ids; it is stable because test checkpoints train their tokenizer on a fixed
corpus (`tests/agent_runtime/tiny_checkpoints.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agent_runtime import names
from agent_runtime.names import ORIGIN_ROLLOUT
from agent_runtime.policies.base import batches
from learner.config import RolloutConfig
from learner.grpo import Episode, Group


@dataclass
class ToyTask:
    """One-call task: any answer; reward = share of even token ids among its text tokens."""
    id: str
    prompt: str


def toy_tasks(n: int, seed: int = 0) -> list[ToyTask]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "calc", "tests", "fix", "add", "sum", "list"]
    return [ToyTask(f"toy-{seed}-{i}", f"Say something about {' '.join(rng.sample(words, 3))}.")
            for i in range(n)]


def toy_reward(completion_ids: Sequence[int], stop_ids: Sequence[int]) -> float:
    text = [t for t in completion_ids if t not in set(stop_ids)]
    return sum(t % 2 == 0 for t in text) / len(text) if text else 0.0


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
            reward = toy_reward(c.completion_ids, policy.stop_token_ids)
            store.set_status(sid, names.FINISHED, summary=f"reward {reward:.3f}")
            episodes.append(Episode(sid, reward, passed=reward > 0.5))
    samples = [store.samples(e.session_id) for e in episodes]
    return Group(task.id, episodes, samples)
