"""`FollowingPolicy`: a policy that takes on newer weights between its model calls.

Whoever publishes versions hands it a `catch_up(policy)` that brings the wrapped policy to the
newest weights it knows of: the runtime's `Subscriber` (deltas from a version server,
`agent_runtime.subscriber.follow`) or the learner's shared-memory weight board (rollout
workers). It is called before every model call, `complete` and, where the wrapped policy
batches, `complete_many`, never during one, so a generation finishes on the weights it began
with and every sample carries the version that produced it.
"""

from __future__ import annotations

from typing import Any, Callable

from agent_runtime.policies.base import Completion, batches


class FollowingPolicy:
    """`policy`, brought up to date by `catch_up(policy)` before each of its model calls."""

    def __init__(self, policy: Any, catch_up: Callable[[Any], Any]):
        self.policy, self.catch_up = policy, catch_up

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def context_window(self) -> int:
        return self.policy.context_window

    @context_window.setter
    def context_window(self, value: int) -> None:
        self.policy.context_window = value

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return self.policy.count_tokens(messages, tools)

    def complete(self, messages: list[dict], tools: list[dict] | None = None,
                 **kw: Any) -> Completion:
        self.catch_up(self.policy)
        return self.policy.complete(messages, tools, **kw)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.policy, name)
        if name == "complete_many" and batches(self.policy):
            def complete_many(*args: Any, **kwargs: Any) -> list[Completion]:
                self.catch_up(self.policy)
                return attr(*args, **kwargs)
            return complete_many
        return attr
