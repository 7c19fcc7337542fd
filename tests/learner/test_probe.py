"""learner.recipe.probe: the rewordings it scores, the prompt it scores them after, and its
margins against transformers' own forward pass on the same prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from learner.recipe.probe import name_margins, prompt_ids, variants  # noqa: E402


def test_variants_keep_the_task_and_drop_only_an_opening_sentence():
    v = variants("We are standardising names in shop. `a_b` must become `c_d`; see `x.py`.")
    assert v["as worded"].startswith("We are") and v["'Hi.' before it"].startswith("Hi. We are")
    assert v["first sentence dropped"] == "`a_b` must become `c_d`; see `x.py`."
    assert "first sentence dropped" not in variants("Rename `a` to `b`. Then run the tests.")
    assert "first sentence dropped" not in variants("`a` must become `b`.")


def test_margins_are_the_log_probabilities_transformers_gives_the_two_names(tmp_path):
    from transformers import AutoModelForCausalLM
    from agent_runtime.policies.engine import EnginePolicy
    from learner.tasks import generate
    from learner.tasks.rename import PHRASES
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    policy = EnginePolicy.load(str(ckpt))
    policy.model.float()
    tasks = generate("heldout", 2, families=["rename_symbol"])
    margins = name_margins(policy, tasks)
    assert sum(len(m) for m in margins.values()) == sum(len(variants(t.instruction)) for t in tasks)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    tok = policy.tokenizer

    def logp(prefix, name):
        ids = tok.encode(name)
        with torch.no_grad():
            lp = hf(torch.tensor([prefix + ids])).logits[0].log_softmax(-1)
        return sum(lp[len(prefix) - 1 + i, t].item() for i, t in enumerate(ids))

    task = tasks[0]
    prefix = prompt_ids(policy, task.instruction)
    assert tok.decode(prefix).endswith(task.instruction + "<|im_end|>\n<|im_start|>assistant\n"
                                       'Let me find all uses.\n<tool_call>\n{"name": "grep", '
                                       '"arguments": {"pattern": "')
    expected = logp(prefix, task.meta["old"]) - logp(prefix, task.meta["new"])
    got = margins[(PHRASES[task.meta["phrase"][0]].text[:40], "as worded")][0]
    assert abs(got - expected) < 1e-3, (got, expected)
    assert abs(expected) > 1e-6                         # the two names differ in the model
