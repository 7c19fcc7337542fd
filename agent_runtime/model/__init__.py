"""The MoE policy engine: model, checkpoints, tokenizer, chat template and generation.

    model = load_model(path, dtype="bfloat16")      # HF-format MoE checkpoint directory
    out = model(input_ids)                          # .logits [B,T,V], .routes [B,T,L,k]
    out = model(input_ids, routes=recorded)         # router replay
    tok = load_tokenizer(path)                      # tiktoken-backed

Names are imported lazily: the tokenizer and chat template do not need torch, so the scripted
policy and the command line start without importing it.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CheckpointError": "agent_runtime.model.checkpoint",
    "load_model": "agent_runtime.model.checkpoint",
    "save_model": "agent_runtime.model.checkpoint",
    "ConfigError": "agent_runtime.model.config",
    "ModelArgs": "agent_runtime.model.config",
    "KVCache": "agent_runtime.model.model",
    "ModelOutput": "agent_runtime.model.model",
    "MoEModel": "agent_runtime.model.model",
    "token_logprobs": "agent_runtime.model.model",
    "load_tokenizer": "agent_runtime.model.tokenizer",
    "Tokenizer": "agent_runtime.model.tokenizer",
    "ChatTemplate": "agent_runtime.model.chat_template",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'agent_runtime.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
