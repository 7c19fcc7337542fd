"""Tiny random Hugging Face MoE checkpoints, made offline with `transformers` (test-only).

Every family gets the switches that make it different turned on (shared expert, dense layers,
q/k norms, clip_qkv, tied embeddings, granite multipliers, non-default rope theta), and weights
are re-drawn with a large spread so routing and logits are far from uniform.
"""

from __future__ import annotations

import zlib
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
    """Each parameter is drawn from its own generator, seeded by `seed` and the parameter's
    name: the weights do not depend on the order `transformers` creates modules in."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **over)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)          # U(0.5, 1.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def save_hf_checkpoint(family: str, path: Path, seed: int = 0, **over) -> Path:
    model = make_hf_model(family, seed=seed, **over)
    model.save_pretrained(path)
    return Path(path)


CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The tiny tokenizers' training text, fixed: editing any other file (this one included) must
# not reshuffle the ids every tiny checkpoint uses.
TOKENIZER_CORPUS = """<|im_start|>system
You are a coding agent. You work in a repository through the tools below.
# Tools
<tools>
{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
{"type": "function", "function": {"name": "run_command", "parameters": {"command": "python -m pytest -q"}}}
</tools>
<|im_end|>
<|im_start|>user
Fix calc.py so that add() adds. List the files. Say hello. Run the tests.<|im_end|>
<|im_start|>assistant
Let me look at the code first.
<tool_call>
{"name": "read_file", "arguments": {"path": "calc.py"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
def add(a, b):
    return a - b


def multiply(a, b):
    return a * b
</tool_response><|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "edit_file", "arguments": {"path": "calc.py", "old": "return a - b", "new": "return a + b"}}
</tool_call>
<tool_call>
{"name": "finish", "arguments": {"summary": "Fixed add in calc.py; the tests pass."}}
</tool_call><|im_end|>
Tiny random Hugging Face MoE checkpoints, made offline with transformers (test-only). Every
family gets the switches that make it different turned on (shared expert, dense layers, q/k
norms, clip_qkv, tied embeddings, granite multipliers, non-default rope theta), and weights are
re-drawn with a large spread so routing and logits are far from uniform. for name, p in
model.named_parameters(): if "norm" in name: p.uniform_(0.5, 1.5) else: p.normal_(0.0, std)
import json, os, sys; from pathlib import Path; def main() -> None: print([1, 2, 3]) 0123456789
"""


def save_tiny_agent_checkpoint(path: Path, family: str = "qwen2_moe", vocab: int = 640) -> Path:
    """A tiny random MoE plus a real byte-level BPE tokenizer and the default chat template:
    everything `load_policy(path)` needs, made offline."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from agent_runtime.model.chat_template import DEFAULT_CHAT_TEMPLATE

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [TOKENIZER_CORPUS] * 4
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(CHATML), special_tokens=CHATML,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = make_hf_model(family, vocab_size=vocab, max_position_embeddings=8192)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": DEFAULT_CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None}))
    return path
