"""Policies: what the agent loop asks for the next assistant message.

- `base`: the `Policy` protocol, `Completion`, the optional capabilities (`batches`,
  `has_weights`), checkpoints;
- `loading`: `load_policy(spec)` and `check_policy(spec)`;
- `engine`: `EnginePolicy`, our MoE engine behind the protocol;
- `replay`: `ReplayPolicy`, the scripted policy of tests and demos;
- `batching`: `BatchingPolicy`, many agent threads decoded as one batch;
- `following`: `FollowingPolicy`, newer weights taken on between model calls.

Imports run one way (`loading` -> `engine`, `replay` -> `base`); names are imported lazily
so that `import agent_runtime.policies` does not import torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Completion": "base", "Policy": "base", "batches": "base", "has_weights": "base",
    "resolve_model_path": "base",
    "DEFAULT_MODEL_DIR": "base",
    "load_policy": "loading", "check_policy": "loading",
    "EnginePolicy": "engine", "EngineConfig": "engine",
    "ReplayPolicy": "replay", "ReplayExhausted": "replay",
    "BatchingPolicy": "batching",
    "FollowingPolicy": "following",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'agent_runtime.policies' has no attribute {name!r}")
    return getattr(importlib.import_module(f"agent_runtime.policies.{_LAZY[name]}"), name)
