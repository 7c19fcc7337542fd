"""The MoE policy engine: model, checkpoints, tokenizer, chat template and generation.

    model = load_model(path, dtype="bfloat16")      # HF-format MoE checkpoint directory
    out = model(input_ids)                          # .logits [B,T,V], .routes [B,T,L,k]
    out = model(input_ids, routes=recorded)         # router replay
    tok = load_tokenizer(path)                      # tiktoken-backed
"""

from agent_runtime.model.checkpoint import CheckpointError, load_model, save_model
from agent_runtime.model.config import ConfigError, ModelArgs
from agent_runtime.model.model import KVCache, ModelOutput, MoEModel


def load_tokenizer(path):
    """Build the tiktoken-backed tokenizer of a checkpoint (see `tokenizer.py`)."""
    from agent_runtime.model.tokenizer import load_tokenizer as _load
    return _load(path)


__all__ = ["CheckpointError", "ConfigError", "KVCache", "ModelArgs", "ModelOutput", "MoEModel",
           "load_model", "load_tokenizer", "save_model"]
