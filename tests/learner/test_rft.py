"""Expert iteration (`learner.recipe.rft`): only honest passes become training sequences, the
way the model wrote them; each round fine-tunes the last round's model and resumes."""

import json
import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agent_runtime.model import load_model, load_tokenizer, save_model
from agent_runtime.model.chat_template import COMPACT_CHAT_TEMPLATE, ChatTemplate
from learner.recipe import tokenizer_stage as ts, toy_recipe
from learner.recipe.lm import LMConfig
from learner.recipe.pretrain import ModelShape, copy_tokenizer, init_model
from learner.recipe.rft import RFTConfig, collect, run
from learner.recipe.sft import RecordingOracle, load_sequences, save_sequences
from learner.recipe.ship import summary
from learner.recipe.stages import MissingStage, _start, run_recipe
from learner.tasks import generate

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  num_experts=8, top_k=2, expert_size=32, max_position=8192)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    texts = [t.instruction + "".join(c for c in t.files.values() if isinstance(c, str))
             for t in generate("train", 12, seed=1)]
    tok_dir = ts.save_tokenizer(ts.build_tokenizer(ts.train_bpe(ts.word_counts(texts), 300)),
                                tmp_path_factory.mktemp("tok"), COMPACT_CHAT_TEMPLATE)
    out = tmp_path_factory.mktemp("model")
    save_model(init_model(TINY, load_tokenizer(tok_dir), 0), out)
    copy_tokenizer(tok_dir, out)
    return out


TASKS = dict(tasks=3, task_seed=7)          # the round's tasks: generate("train", 3, seed=7)


def oracles(model_dir: Path, wrong: str | None = None):
    """Each task's recording oracle (rendering with the model's tokenizer), except that task
    `wrong` gets the first task's oracle, whose plan does not solve it; and the tasks seen."""
    tok, template = load_tokenizer(model_dir), ChatTemplate.from_pretrained(model_dir)
    first = generate("train", TASKS["tasks"], seed=TASKS["task_seed"])[0]
    seen: list[str] = []

    def policy_for(task):
        seen.append(task.id)
        return RecordingOracle(first if task.id == wrong else task, tok, template, 4096)
    return policy_for, seen


def config(**kw) -> RFTConfig:
    base = RFTConfig(rounds=1, concurrency=1, max_steps=30, sandbox="auto", **TASKS)
    return replace(base, sft=replace(base.sft, train=LMConfig(
        steps=2, lr=1e-3, warmup=1, weight_decay=0.0, checkpoint_every=1, log_every=1,
        head_on_mask=True)), **kw)


def test_only_honest_passes_become_sequences_as_written(model_dir, tmp_path):
    tasks = generate("train", TASKS["tasks"], seed=TASKS["task_seed"])
    policy_for, seen = oracles(model_dir, wrong=tasks[1].id)
    got = collect(model_dir, tmp_path / "own.npz", config(), 0, policy_for)
    assert seen == [t.id for t in tasks]
    assert got["tasks"] == 3 and got["passed"] == 2
    assert sum(int(v.split("/")[0]) for v in got["families"].values()) == 2
    seqs = load_sequences(tmp_path / "own.npz")
    assert len(seqs) == got["sequences"] >= 2
    tok = load_tokenizer(model_dir)
    trained = [tok.decode([int(t) for t, m in zip(ids, mask) if m]) for ids, mask in seqs]
    whole = [tok.decode([int(t) for t in ids]) for ids, _ in seqs]
    # the completions are trained on (each ends its turn), the tool results are context
    assert all("<tool_call>" in t and "<tool_response>" not in t for t in trained)
    assert sum(t.count('"finish"') for t in trained) == 2
    assert any("<tool_response>" in w for w in whole)
    # the failed task's episode is nowhere: its instruction is in no sequence
    assert not any(tasks[1].instruction[:40] in w for w in whole)
    assert all(any(t.instruction[:40] in w for w in whole) for t in (tasks[0], tasks[2]))


def test_a_round_fine_tunes_on_own_passes_mixed_with_oracle_data_and_resumes(model_dir, tmp_path):
    oracle = tmp_path / "oracle.npz"
    save_sequences(oracle, [([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1])] * 9)
    policy_for, seen = oracles(model_dir)
    out = tmp_path / "rft"
    result = run(model_dir, out, config(oracle_mix=2.0), oracle, log=lambda row: None,
                 policy_for=policy_for)
    (r0,) = result["rounds"]
    assert r0["collect"]["passed"] == 3 and r0["train"]["steps"] == 2
    own = r0["collect"]["sequences"]
    assert r0["oracle_sequences"] == min(9, 2 * own)
    assert len(load_sequences(out / "round-0" / "data.npz")) == own + r0["oracle_sequences"]
    before, after = load_model(model_dir), load_model(out / "model")
    assert any((a != b).any() for a, b in zip(before.state_dict().values(),
                                              after.state_dict().values()))
    assert load_tokenizer(out / "model").encode("x = 1") == load_tokenizer(model_dir).encode("x = 1")
    # a rerun finds the round done: no episode runs again, the same model comes out
    seen.clear()
    again = run(model_dir, out, config(oracle_mix=2.0), oracle, log=lambda row: None,
                policy_for=policy_for)
    assert seen == [] and again["rounds"] == result["rounds"]


def test_a_round_with_no_pass_keeps_the_model(model_dir, tmp_path):
    tok, template = load_tokenizer(model_dir), ChatTemplate.from_pretrained(model_dir)
    other = generate("train", 1, seed=99)[0]
    out = tmp_path / "rft"
    result = run(model_dir, out, config(tasks=1), log=lambda row: None,
                 policy_for=lambda task: RecordingOracle(other, tok, template, 4096))
    assert result["rounds"][0]["collect"]["passed"] == 0 and "train" not in result["rounds"][0]
    before, after = load_model(model_dir), load_model(out / "model")
    assert all((a == b).all() for a, b in zip(before.state_dict().values(),
                                              after.state_dict().values()))


def test_the_recipe_stage_with_no_rounds_leaves_grpo_and_eval_the_sft_model(model_dir, tmp_path):
    out = tmp_path / "recipe"
    shutil.copytree(model_dir, out / "sft" / "model")
    config = toy_recipe()
    with pytest.raises(MissingStage, match="stage rft reads the output of sft_data"):
        run_recipe(out, config, ("rft",), log=lambda line: None)   # a clear error, no traceback
    (out / "sft_data").mkdir()
    (out / "sft_data" / "data.npz").write_bytes(b"")
    config.rft = replace(config.rft, rounds=0)
    results = run_recipe(out, config, ("rft",), log=lambda line: None)
    assert results["rft"]["rounds"] == [] and not (out / "rft" / "model").exists()
    assert _start(out) == out / "sft" / "model"


def test_the_grpo_stage_averages_independent_runs_on_different_pools_and_resumes(model_dir,
                                                                                 tmp_path):
    out = tmp_path / "recipe"
    shutil.copytree(model_dir, out / "sft" / "model")
    config = toy_recipe()
    config.grpo = replace(config.grpo, runs=2, task_seed=5)
    results = run_recipe(out, config, ("grpo",), log=lambda line: None)["grpo"]
    runs = results["runs"]
    assert [r["task_seed"] for r in runs] == [5, 6]               # two pools, one start
    assert results["steps"] == sum(r["steps"] for r in runs) >= 2
    played = []
    for i in range(2):
        with sqlite3.connect(out / "grpo" / f"run{i}" / "home" / "apprentice.db") as db:
            played.append({row[0] for row in db.execute("SELECT task_id FROM rewards")})
    assert played[0] and played[1] and not played[0] & played[1]
    # stopped during its second run, and the first run's model is not the start (a toy
    # model's groups all fail, so its runs leave the weights as they were): a rerun keeps
    # the first run as it is on disk, runs the second again, and averages the two
    first = load_model(out / "grpo" / "run0" / "model")
    with torch.no_grad():
        for p in first.parameters():
            p.add_(0.25)
    save_model(first, out / "grpo" / "run0" / "model")
    shutil.rmtree(out / "grpo" / "run1")
    (out / "grpo" / "metrics.json").unlink()
    lines: list[str] = []
    again = run_recipe(out, config, ("grpo",), log=lines.append)["grpo"]
    assert any("run=0 done_already=True" in line for line in lines)
    assert again["runs"][0] == runs[0] and again["runs"][1]["task_seed"] == 6
    parts = [load_model(out / "grpo" / f"run{i}" / "model").state_dict() for i in range(2)]
    for k, v in load_model(out / "grpo" / "model").state_dict().items():
        assert torch.equal(v, ((parts[0][k].float() + parts[1][k].float()) / 2).to(v.dtype)), k
        assert not torch.equal(v, parts[1][k]), k
    (out / "grpo" / "metrics.json").unlink()
    config.grpo = replace(config.grpo, runs=0)
    with pytest.raises(ValueError, match="grpo.runs must be at least 1"):
        run_recipe(out, config, ("grpo",), log=lambda line: None)


def test_the_grpo_stage_takes_the_mean_of_its_run_and_its_start(model_dir, tmp_path):
    out = tmp_path / "recipe"
    shutil.copytree(model_dir, out / "sft" / "model")
    config = toy_recipe()
    config.grpo = replace(config.grpo, start_share=0.25)
    results = run_recipe(out, config, ("grpo",), log=lambda line: None)["grpo"]
    assert results["start_share"] == 0.25 and len(results["runs"]) == 1
    assert (out / "grpo" / "run0" / "metrics.json").exists()
    # a toy model's groups all fail, so its run leaves the weights as they were: move the
    # run's model, and a rerun of the stage keeps it and weighs it 3 to the start's 1
    run = load_model(out / "grpo" / "run0" / "model")
    with torch.no_grad():
        for p in run.parameters():
            p.add_(0.5)
    save_model(run, out / "grpo" / "run0" / "model")
    (out / "grpo" / "metrics.json").unlink()
    run_recipe(out, config, ("grpo",), log=lambda line: None)
    start = load_model(out / "sft" / "model").state_dict()
    ran = load_model(out / "grpo" / "run0" / "model").state_dict()
    for k, v in load_model(out / "grpo" / "model").state_dict().items():
        want = (0.75 * ran[k].float() + 0.25 * start[k].float()).to(v.dtype)
        assert torch.equal(v, want), k
    record = summary(out)["grpo"]                       # what `ship` writes to recipe.json
    assert record["start_share"] == 0.25 and record["runs"][0]["steps"] >= 1
    assert "history" not in json.dumps(record)
    (out / "grpo" / "metrics.json").unlink()
    config.grpo = replace(config.grpo, start_share=1.0)
    with pytest.raises(ValueError, match=r"grpo.start_share is a share in \[0, 1\)"):
        run_recipe(out, config, ("grpo",), log=lambda line: None)
