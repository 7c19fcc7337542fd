"""The shipped default model: its shape, its record, and the same logits in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from agent_runtime.policies import DEFAULT_MODEL_DIR, load_policy, resolve_model_path

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(),
                                reason="this build ships no default model")


def test_default_model_is_a_small_moe_with_its_recipe_record(monkeypatch):
    monkeypatch.delenv("APPRENTICE_DEFAULT_MODEL", raising=False)
    assert resolve_model_path("default") == DEFAULT_MODEL_DIR
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir())
    assert size <= 50 * 2**20
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["num_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2
    assert cfg["max_position_embeddings"] >= 4096
    record = json.loads((DEFAULT_MODEL_DIR / "recipe.json").read_text())
    assert record["stages"]["pretrain"]["seconds"] > 0


def test_default_model_loads_and_transformers_gives_the_same_logits(monkeypatch):
    import transformers
    monkeypatch.delenv("APPRENTICE_DEFAULT_MODEL", raising=False)
    policy = load_policy("default", dtype="float32")
    ids = torch.tensor([policy.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    ref = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(policy.model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_turn_of_the_default_model_ends_where_its_template_ends_an_assistant_message(
        monkeypatch):
    """It stops on `<|endoftext|>` or `<|im_end|>`; its template ends an assistant message with
    `<|im_end|>`, which is what a turn written for it must end with (`end_of_turn_id`)."""
    monkeypatch.delenv("APPRENTICE_DEFAULT_MODEL", raising=False)
    policy = load_policy("default")
    specials = policy.tokenizer.special_tokens
    assert {specials["<|endoftext|>"], specials["<|im_end|>"]} <= set(policy.stop_token_ids)
    assert policy.end_of_turn_id == specials["<|im_end|>"]
    ids = policy.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "and?"}])
    ok = policy.tokenizer.encode("ok")
    at = next(i for i in range(len(ids)) if ids[i:i + len(ok)] == ok) + len(ok)
    assert ids[at] == policy.end_of_turn_id
