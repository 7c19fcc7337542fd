"""Between the app and the runtime: settings, policy loading, display names, learner updates.

`Settings` is what the `tui` command hands the app. `load` turns the policy options into a
policy or a message the app shows instead of crashing (no default model is shipped yet).
`FollowingPolicy` lets a policy take on versions a `Subscriber` staged from the learner's
version server, between model calls. Nothing here touches Textual or runs the agent.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

NO_DEFAULT_MODEL = "no default model; start with --model PATH or --policy replay:FILE"


@dataclass
class Settings:
    workspace: Path = field(default_factory=Path.cwd)  # the repository the agent works in
    model: str = "default"                     # checkpoint directory, or "default"
    policy_spec: str | None = None             # overrides `model`, e.g. "replay:FILE"
    max_steps: int = 50                        # model calls per prompt before the run stops
    context_window: int | None = None          # override of the policy's window (tokens)
    approval: str = "ask"                      # ask | auto-edit | full-auto (see approvals.py)
    connect: str | None = None                 # version server URL to follow (learner updates)
    token: str = ""                            # bearer token for the version server

    @property
    def spec(self) -> str:
        return self.policy_spec or self.model


def load(settings: Settings) -> tuple[Any, str | None]:
    """(policy, None), or (None, a message for the user) when the policy cannot be loaded."""
    from agent_runtime.policy import load_policy
    spec = settings.spec
    try:
        policy = load_policy(spec)
    except FileNotFoundError as exc:
        if spec == "default":
            return None, f"{NO_DEFAULT_MODEL}\n({exc})"
        return None, f"cannot load policy {spec!r}: {exc}"
    except Exception as exc:                   # a broken checkpoint or script: say so, keep the UI
        return None, f"cannot load policy {spec!r}: {type(exc).__name__}: {exc}"
    if settings.context_window:
        policy.context_window = settings.context_window
    return policy, None


def display_name(policy_name: str) -> str:
    """A short model name for the footer: no directories (they vary between machines)."""
    if policy_name.startswith("replay:"):
        return "replay:" + Path(policy_name[len("replay:"):]).name
    if "/" in policy_name or os.sep in policy_name:
        return Path(policy_name.rstrip("/" + os.sep)).name or policy_name
    return policy_name


def short_path(path: str | Path) -> str:
    """`path` with the home directory written as ~."""
    path = Path(path)
    try:
        return "~/" + str(path.relative_to(Path.home())) if path != Path.home() else "~"
    except ValueError:
        return str(path)


class FollowingPolicy:
    """A policy that applies the version the subscriber staged before each model call.

    The agent loop does not poll for new versions itself; wrapping the policy keeps the swap
    between model calls, so a generation always finishes on the weights it started with.
    """

    def __init__(self, policy: Any, subscriber: Any,
                 on_swap: Callable[[int, str | None], None] | None = None):
        self.policy, self.subscriber, self.on_swap = policy, subscriber, on_swap

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def context_window(self) -> int:
        return self.policy.context_window

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return self.policy.count_tokens(messages, tools)

    def complete(self, messages: list[dict], tools: list[dict] | None = None, **kw: Any) -> Any:
        self.swap()
        return self.policy.complete(messages, tools, **kw)

    def swap(self) -> int | None:
        policy = self.policy

        def apply(patch: Any) -> None:
            policy.swap_state(lambda _state: patch.commit(policy.model), patch.to_version)

        version = self.subscriber.poll_swap(apply)
        if version is not None and self.on_swap is not None:
            self.on_swap(version, self.subscriber.sha256)
        return version

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def follow(policy: Any, settings: Settings, store: Any) -> tuple[Any, Any]:
    """(policy, subscriber): start following `settings.connect` when the policy can swap."""
    if not settings.connect or policy is None:
        return policy, None
    if not hasattr(policy, "swap_state") or not hasattr(policy, "model"):
        return policy, None
    from agent_runtime.subscriber import Subscriber
    subscriber = Subscriber(policy.model, settings.connect, settings.token).start()

    def record(version: int, sha256: str | None) -> None:
        try:
            if sha256:
                store.record_policy_version(version, sha256, source=settings.connect)
        except ValueError as exc:              # a conflicting record must not stop the agent
            log.warning("policy version %s not recorded: %s", version, exc)

    return FollowingPolicy(policy, subscriber, on_swap=record), subscriber


def learner_status(settings: Settings, policy: Any, subscriber: Any) -> str:
    """The footer's learner field."""
    if subscriber is not None:
        return str(getattr(subscriber, "status", "connected"))
    if settings.connect and policy is not None:
        return "not followed (needs a model checkpoint, not a replay script)"
    return "off"
