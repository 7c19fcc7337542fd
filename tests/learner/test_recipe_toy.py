"""The whole recipe, every stage, at toy scale (what `apprentice learn recipe toy` runs)."""

from __future__ import annotations

import json

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
