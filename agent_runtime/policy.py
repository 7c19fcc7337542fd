"""Policies: what the agent loop asks for the next assistant message.

`Policy` is the protocol the loop depends on. `load_policy` builds one from a spec:
`"default"` or a checkpoint directory (the MoE engine, `EnginePolicy`), or
`"replay:FILE"` (the scripted policy that replays assistant texts from a JSON list).
This module does not render prompts itself; the policy's `ChatTemplate` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default"


@dataclass
class Completion:
    """One model call, as the loop and the store see it."""
    text: str                                  # decoded completion (stop string excluded)
    prompt_ids: list[int]                      # token ids of the rendered prompt, as fed
    completion_ids: list[int]                  # token ids as generated, never re-rendered
    logprobs: list[float]                      # behaviour logprob of each completion token
    routes: Any = None                         # np.ndarray [T, L, k] uint8/int16, or None
    finish_reason: str = "stop"                # "stop" | "length" | "eos" | "cancelled"
    version: int = 0                           # policy version that produced it
    meta: dict[str, Any] = field(default_factory=dict)
    temperature: float | None = None           # what the logprobs are of: logits / T (0:
                                               # greedy, unscaled); None: not a model's


@runtime_checkable
class Policy(Protocol):
    name: str                                  # e.g. "default", a path, "replay:steps.json"
    version: int                               # current policy version (changes on hot swap)
    context_window: int                        # in this policy's own tokens

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """Tokens of the rendered prompt (with the generation prompt appended)."""
        ...

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *,
                 max_new_tokens: int | None = None,
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Completion:
        """Render `messages`, generate the next assistant message, return it."""
        ...


def resolve_model_path(spec: str) -> Path:
    """`"default"` -> the model shipped in the package (or $APPRENTICE_DEFAULT_MODEL); else a
    checkpoint directory. Raises FileNotFoundError with what to do instead (no torch needed)."""
    if spec == "default":
        path = Path(os.environ.get("APPRENTICE_DEFAULT_MODEL", DEFAULT_MODEL_DIR))
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"no default model at {path}: this build ships none yet. Pass --model PATH (an HF "
                "MoE checkpoint directory) or --policy replay:FILE")
        return path
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    return path


def check_policy(spec: str) -> None:
    """Raise what `load_policy(spec)` would on a missing or unrunnable checkpoint (or replay
    file), without loading weights or importing torch: OSError or ValueError with one line
    that says what is wrong. Servers call it at start, before their first request."""
    if spec.startswith("replay:"):
        path = Path(spec[len("replay:"):]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"replay script {path} does not exist")
        return
    import json

    from agent_runtime.model.config import args_from_hf
    path = resolve_model_path(spec)
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({exc})") from None
    args_from_hf(config)


def load_policy(spec: str = "default", **kwargs: Any) -> Policy:
    """Build a policy from `"default"`, a checkpoint path, or `"replay:FILE"`."""
    if spec.startswith("replay:"):
        from agent_runtime.replay_policy import ReplayPolicy
        return ReplayPolicy.from_file(spec[len("replay:"):], **kwargs)
    check_policy(spec)                         # fail fast, before importing torch
    from agent_runtime.engine_policy import EnginePolicy
    return EnginePolicy.load(spec, **kwargs)
