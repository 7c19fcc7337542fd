"""Tiny random Hugging Face MoE checkpoints, made offline with `transformers` (test-only).

Every family gets the switches that make it different turned on (shared expert, dense layers,
q/k norms, clip_qkv, tied embeddings, granite multipliers, non-default rope theta), and weights
are re-drawn with a large spread so routing and logits are far from uniform.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "granitemoe")
VOCAB = 160


def hf_config(family: str, **over):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if family == "qwen2_moe":
        cls, kw = transformers.Qwen2MoeConfig, dict(moe_intermediate_size=24, intermediate_size=56,
                                          shared_expert_intermediate_size=40, num_experts=8,
                                          num_experts_per_tok=2, mlp_only_layers=[1],
                                          norm_topk_prob=False, rope_theta=50000.0)
    elif family == "qwen3_moe":
        cls, kw = transformers.Qwen3MoeConfig, dict(moe_intermediate_size=24, intermediate_size=56,
                                          num_experts=8, num_experts_per_tok=3, head_dim=16,
                                          norm_topk_prob=True)
    elif family == "olmoe":
        cls, kw = transformers.OlmoeConfig, dict(intermediate_size=24, num_experts=8,
                                       num_experts_per_tok=2, clip_qkv=4.0, norm_topk_prob=False)
    elif family == "mixtral":
        cls, kw = transformers.MixtralConfig, dict(intermediate_size=24, num_local_experts=8,
                                         num_experts_per_tok=2, tie_word_embeddings=True,
                                         rope_theta=1e6)
    elif family == "granitemoe":
        cls, kw = transformers.GraniteMoeConfig, dict(intermediate_size=24, num_local_experts=8,
                                            num_experts_per_tok=2, embedding_multiplier=3.0,
                                            residual_multiplier=0.5, attention_multiplier=0.2,
                                            logits_scaling=2.5)
    else:
        raise ValueError(family)
    return cls(**{**common, **kw, **over})


def make_hf_model(family: str, seed: int = 0, std: float = 0.15, **over):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **over)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model


def save_hf_checkpoint(family: str, path: Path, seed: int = 0, **over) -> Path:
    model = make_hf_model(family, seed=seed, **over)
    model.save_pretrained(path)
    return Path(path)
