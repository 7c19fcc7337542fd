"""apprentice's agent runtime: the MoE engine, policy, tools, sandbox, agent loop and store.

The runtime never imports `learner`, `tui` or `plugins`. Public names are imported lazily so
that `import agent_runtime` stays cheap (no torch import until a model is needed).
"""

from __future__ import annotations

import importlib

__all__ = ["load_policy", "Agent", "SessionStore", "delta"]

_LAZY = {
    "load_policy": ("agent_runtime.policies.loading", "load_policy"),
    "Agent": ("agent_runtime.agent", "Agent"),
    "SessionStore": ("agent_runtime.store", "SessionStore"),
    "delta": ("agent_runtime.delta", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'agent_runtime' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
