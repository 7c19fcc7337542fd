"""Between the app and the runtime: settings, policy loading, display names, learner updates.

`Settings` is what the `tui` command hands the app. `load` turns the policy options into a
policy or a message the app shows instead of crashing (no default model is shipped yet).
`follow` wraps a policy so it takes on the versions a learner's version server publishes
(`agent_runtime.subscriber.FollowingPolicy`). Nothing here touches Textual or runs the agent.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    learn: bool = True                         # False: never learn from these sessions

    @property
    def spec(self) -> str:
        return self.policy_spec or self.model


def load(settings: Settings) -> tuple[Any, str | None]:
    """(policy, None), or (None, a message for the user) when the policy cannot be loaded."""
    from agent_runtime.policies import load_policy
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


def follow(policy: Any, settings: Settings, store: Any) -> tuple[Any, Any]:
    """(policy, subscriber): start following `settings.connect` when the policy can swap."""
    if not settings.connect or policy is None:
        return policy, None
    from agent_runtime.subscriber import follow as follow_server
    return follow_server(policy, settings.connect, settings.token, store)


def learner_status(settings: Settings, policy: Any, subscriber: Any,
                   local: str | None = None) -> str:
    """The footer's learner field: the subscriber's state when following a server, and the
    local learner's (`agent_runtime.learning.status_line`, when known)."""
    if subscriber is not None:
        following = str(getattr(subscriber, "status", "connected"))
    elif settings.connect and policy is not None:
        following = "not followed (needs a model checkpoint, not a replay script)"
    else:
        return local or "off"
    return following if local in (None, "off") else f"{local} · {following}"


def local_learner(store: Any) -> str:
    """The home's learner in one line (daemon on/off, serving version, waiting, last cycle)."""
    from agent_runtime.learning import learner_status, status_line
    return status_line(learner_status(store))
