"""`ModelArgs`: one dataclass that describes every supported MoE family.

Reads a Hugging Face `config.json` (qwen2_moe, qwen3_moe, olmoe, mixtral, granitemoe) into the
handful of switches our single decoder implementation needs. It does not load weights and does
not know tensor names (see `checkpoint.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "granitemoe")


class ConfigError(ValueError):
    """A config.json we cannot run, naming the offending field."""


@dataclass
class ModelArgs:
    model_type: str                         # one of FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int                              # experts per token
    expert_size: int                        # intermediate width of one routed expert
    dense_size: int = 0                     # intermediate width of dense (non-MoE) MLP layers
    moe_layers: list[bool] = field(default_factory=list)  # per layer: MoE block or dense MLP
    shared_expert_size: int = 0             # qwen2_moe: shared expert width (0 = none)
    router_mode: str = "softmax_topk"       # "softmax_topk" or "topk_softmax" (granitemoe)
    norm_topk_prob: bool = False            # renormalize the top-k probabilities to sum to 1
    qkv_bias: bool = False                  # bias on q/k/v projections
    o_bias: bool = False                    # bias on the output projection
    qk_norm: str = "none"                   # "none" | "head" (qwen3_moe) | "full" (olmoe)
    clip_qkv: float | None = None           # olmoe: clamp q/k/v to [-c, c]
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 4096                # context window
    tie_embeddings: bool = False
    embedding_multiplier: float = 1.0       # granitemoe multipliers (1.0 elsewhere)
    residual_multiplier: float = 1.0
    attention_scale: float | None = None    # None -> head_dim ** -0.5
    logits_scaling: float = 1.0             # logits are divided by this
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"config.json: rope type {rope_type!r} (rope_parameters/rope_scaling) "
                          "is not supported; only default RoPE is")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _require(cfg: dict[str, Any], *names: str) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ConfigError(f"config.json: missing required field {' or '.join(map(repr, names))}")


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """Map a Hugging Face config dict to `ModelArgs`; raise `ConfigError` naming the field."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"config.json: model_type {mt!r} is not supported "
                          f"(supported: {', '.join(FAMILIES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    n_layers = int(_require(cfg, "num_hidden_layers"))
    a = ModelArgs(
        model_type=mt,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_experts=int(_require(cfg, "num_experts", "num_local_experts")),
        top_k=int(_require(cfg, "num_experts_per_tok")),
        expert_size=0,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )
    if a.top_k > a.num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {a.top_k} > number of experts {a.num_experts}")
    a.moe_layers = [True] * n_layers
    if mt in ("qwen2_moe", "qwen3_moe"):
        a.expert_size = int(_require(cfg, "moe_intermediate_size"))
        a.dense_size = int(cfg.get("intermediate_size") or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        a.moe_layers = [(i not in only) and (i + 1) % step == 0 for i in range(n_layers)]
        a.norm_topk_prob = bool(cfg.get("norm_topk_prob", mt == "qwen3_moe"))
        if cfg.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window=true is not supported")
    if mt == "qwen2_moe":
        a.qkv_bias = bool(cfg.get("qkv_bias", True))
        a.shared_expert_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    elif mt == "qwen3_moe":
        a.qkv_bias = a.o_bias = bool(cfg.get("attention_bias", False))
        a.qk_norm = "head"
    elif mt == "olmoe":
        a.expert_size = int(_require(cfg, "intermediate_size"))
        a.qkv_bias = a.o_bias = bool(cfg.get("attention_bias", False))
        a.qk_norm = "full"
        a.clip_qkv = cfg.get("clip_qkv")
        a.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    elif mt == "mixtral":
        a.expert_size = int(_require(cfg, "intermediate_size"))
        a.norm_topk_prob = True
        if cfg.get("sliding_window"):
            raise ConfigError("config.json: sliding_window is not supported for mixtral")
    elif mt == "granitemoe":
        a.expert_size = int(_require(cfg, "intermediate_size"))
        a.qkv_bias = a.o_bias = bool(cfg.get("attention_bias", False))
        a.router_mode = "topk_softmax"
        a.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        a.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        a.attention_scale = float(cfg.get("attention_multiplier", 1.0))
        a.logits_scaling = float(cfg.get("logits_scaling", 1.0))
    return a
