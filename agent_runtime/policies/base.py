"""What every policy is: the `Policy` protocol the agent loop depends on, the `Completion` a
model call returns, the optional capabilities (`complete_many`: decoding several calls as one
batch; `swap_state`: weights that a newer version can replace; `grammar=`: tool calls held to
what can run; `remember`: earlier turns fed as the ids written) and where checkpoints are
found.

This module imports nothing from the project, so every other module of the package (and
`agent_runtime.context`) can import it: the policies' imports run one way, from
`loading` (builds a policy from a spec) to `engine`, `replay`, `batching` and `following`,
each of which needs only this module (`replay` also needs `agent_runtime.context`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default"


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
                f"no default model at {path} (no config.json): reinstall apprentice, set "
                "$APPRENTICE_DEFAULT_MODEL, or pass --model PATH (an HF MoE checkpoint directory)")
        return path
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    return path


def batches(policy: Any) -> bool:
    """Whether `policy` decodes several calls as one batch, the optional capability of the
    `Policy` protocol (the engine has it; a replay script does not):
    `complete_many(messages_per_row, tools=None, *, max_new_tokens=None, on_text=None,
    should_stop=None) -> list[Completion]`, with per-row lists for tools, on_text and
    should_stop."""
    return callable(getattr(policy, "complete_many", None))


def constrains(policy: Any) -> bool:
    """Whether `policy` can hold its tool calls to a grammar, the third optional capability
    of the `Policy` protocol (the engine has it): `complete(..., grammar=CallGrammar)` (and
    `complete_many(..., grammar=[...])`) write only calls that `grammar` accepts
    (`agent_runtime.callgrammar`)."""
    return bool(getattr(policy, "accepts_grammar", False))


def remembers(policy: Any) -> bool:
    """Whether `policy` feeds its own earlier turns as the ids it wrote (token in, token
    out; the engine does): `remember(message, completion)` tells it which assistant message
    of the agent's context a completion became."""
    return callable(getattr(policy, "remember", None))


def has_weights(policy: Any) -> bool:
    """Whether `policy` has weights a newer version can replace in place, the other optional
    capability of the `Policy` protocol (the engine has it; a replay script does not): a
    `model` attribute (the torch module) and `swap_state(update, version)`, which applies
    `update(state_dict)` between two model calls and sets `version`."""
    return (callable(getattr(policy, "swap_state", None))
            and getattr(policy, "model", None) is not None)
