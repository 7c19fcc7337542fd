"""The whole recipe, every stage, at toy scale (what `apprentice learn recipe toy` runs)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from agent_runtime.model import load_model
from agent_runtime.model.chat_template import COMPACT_CHAT_TEMPLATE, ChatTemplate
from learner.recipe import STAGES, run_recipe, toy_recipe


def test_toy_recipe_runs_every_stage_and_ships_a_compact_harness_checkpoint(tmp_path):
    out = tmp_path / "toy"
    results = run_recipe(out, toy_recipe(), log=lambda line: None)
    assert list(results) == list(STAGES)
    assert all((out / stage / "metrics.json").exists() for stage in STAGES)
    assert results["sft_data"]["passed"] == results["sft_data"]["episodes"] > 0
    assert results["sft_data"]["heldout"]["passed"] == 2            # held-out oracle episodes
    assert results["sft_data"]["code"]["passed"] == 3               # code-family episodes
    assert results["sft"]["code"]["steps"] == 2                      # ... the second phase
    assert (out / "sft" / "base" / "model" / "config.json").exists()
    heldout = results["sft"]["heldout"]                              # scored after SFT
    assert heldout["tokens"] > 0 and 0 <= heldout["token_accuracy"] <= 1 and heldout["loss"] > 0
    evals = results["eval"]
    assert [evals[name]["n"] for name in ("sft", "rft", "grpo", "grpo_window_1024")] == [3] * 4
    assert results["rft"]["tasks"] == 2 and (out / "rft" / "model" / "config.json").exists()
    model = out / "grpo" / "model"
    config = json.loads((model / "config.json").read_text())
    assert config["apprentice_harness"] == "compact"
    assert ChatTemplate.from_pretrained(model).source() == COMPACT_CHAT_TEMPLATE
    assert load_model(model).args.num_experts == 8

    # GRPO's time budget is the run's: run again with more steps after its whole budget was
    # spent (as the run's clock says), it resumes from its checkpoint and trains no further
    steps = results["grpo"]["steps"]
    assert json.loads((out / "grpo" / "run" / "clock.json").read_text())["seconds"] > 0
    (out / "grpo" / "run" / "clock.json").write_text(json.dumps({"seconds": 300.0}))
    (out / "grpo" / "metrics.json").unlink()
    config = toy_recipe()
    config.grpo = replace(config.grpo, steps=steps + 2, max_seconds=300.0)
    assert run_recipe(out, config, ("grpo",), log=lambda line: None)["grpo"]["steps"] == steps

    # the SFT model as the mean of the two phases (`CodeConfig.base_share`): the second phase
    # is kept in sft/code, the first as it was, and sft/model weighs them 3 to 1
    (out / "sft" / "metrics.json").unlink()
    config = toy_recipe()
    config.sft = replace(config.sft, code=replace(config.sft.code, base_share=0.25))
    again = run_recipe(out, config, ("sft",), log=lambda line: None)["sft"]
    assert again["code"]["base_share"] == 0.25 and again["code"]["steps"] == 2
    base = load_model(out / "sft" / "base" / "model").state_dict()
    second = load_model(out / "sft" / "code" / "model").state_dict()
    assert any(not torch.equal(base[k], second[k]) for k in base)
    for k, v in load_model(out / "sft" / "model").state_dict().items():
        assert torch.equal(v, (0.75 * second[k].float() + 0.25 * base[k].float()).to(v.dtype)), k
    (out / "sft" / "metrics.json").unlink()
    config.sft = replace(config.sft, code=replace(config.sft.code, base_share=1.0))
    with pytest.raises(ValueError, match=r"sft.code.base_share is a share in \[0, 1\)"):
        run_recipe(out, config, ("sft",), log=lambda line: None)
