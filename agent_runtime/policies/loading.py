"""Building a policy from a spec: `"default"` or a checkpoint directory (the MoE engine,
`EnginePolicy`), or `"replay:FILE"` (the scripted policy that replays assistant texts from a
JSON list). `check_policy` says what is wrong with a spec without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent_runtime.policies.base import Policy, resolve_model_path
from agent_runtime.policies.replay import ReplayPolicy


def check_policy(spec: str) -> None:
    """Raise what `load_policy(spec)` would on a missing or unrunnable checkpoint (or replay
    file), without loading weights or importing torch: OSError or ValueError with one line
    that says what is wrong. Servers call it at start, before their first request."""
    if spec.startswith("replay:"):
        path = Path(spec[len("replay:"):]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"replay script {path} does not exist")
        return
    from agent_runtime.model.config import args_from_hf       # torch-free
    path = resolve_model_path(spec)
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({exc})") from None
    args_from_hf(config)


def load_policy(spec: str = "default", **kwargs: Any) -> Policy:
    """Build a policy from `"default"`, a checkpoint path, or `"replay:FILE"`."""
    if spec.startswith("replay:"):
        return ReplayPolicy.from_file(spec[len("replay:"):], **kwargs)
    check_policy(spec)                         # fail fast, before importing torch
    from agent_runtime.policies.engine import EnginePolicy      # imports torch: only now
    return EnginePolicy.load(spec, **kwargs)
