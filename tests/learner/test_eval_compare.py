"""`apprentice eval --compare`: several checkpoints on the same tasks, pass@1 side by side;
the table it prints; how model names resolve; `evaluate_model`'s counting."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from learner.eval import format_comparison  # noqa: E402

FAST = ["-n", 2, "--max-steps", 1, "--max-new-tokens", 8, "--processes", 1, "--sandbox", "off"]
CELL = re.compile(r"(\d+\.\d)% \((\d+)/(\d+)\)")


@pytest.fixture(autouse=True)
def restore_threads():
    import torch
    old = torch.get_num_threads()                  # an in-process eval shard sets it
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """A recipe folder with an `sft/model`, and a second checkpoint outside it."""
    root = tmp_path_factory.mktemp("recipe")
    save_tiny_agent_checkpoint(root / "sft" / "model")
    other = save_tiny_agent_checkpoint(tmp_path_factory.mktemp("other") / "ckpt",
                                       family="qwen3_moe")
    return root, other


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def result(episodes):
    """An `evaluate_model` result from (task, family, passed) triples."""
    by_family: dict[str, dict] = {}
    for _, family, passed in episodes:
        f = by_family.setdefault(family, {"passed": 0, "n": 0})
        f["passed"] += passed
        f["n"] += 1
    return {"n": len(episodes), "pass_at_1": sum(p for *_, p in episodes) / len(episodes),
            "by_family": by_family,
            "episodes": [{"task": t, "family": f, "passed": p} for t, f, p in episodes]}


def test_the_table_has_a_column_per_model_and_the_difference_in_points():
    sft = result([("a", "fix_bug", True), ("b", "fix_bug", False), ("c", "rename", False)])
    grpo = result([("a", "fix_bug", True), ("b", "fix_bug", True), ("c", "rename", False)])
    lines = format_comparison({"sft": sft, "default": grpo}, verbose=True).splitlines()
    assert lines[0].split() == ["pass@1", "sft", "default"]
    assert lines[1].split() == ["a", "PASS", "PASS"] and lines[2].split() == ["b", "FAIL", "PASS"]
    fix_bug = next(line for line in lines if line.startswith("fix_bug"))
    overall = next(line for line in lines if line.startswith("overall"))
    assert CELL.findall(fix_bug) == [("50.0", "1", "2"), ("100.0", "2", "2")]
    assert CELL.findall(overall) == [("33.3", "1", "3"), ("66.7", "2", "3")]
    assert lines[-1] == "default − sft: +33.3 points"


def test_compare_runs_every_model_on_the_same_tasks(home, recipe):
    root, other = recipe
    out = invoke("eval", "--compare", f"sft,{other}", "--recipe", root, "--json", *FAST)
    assert out.exit_code == 0, out.output
    models = json.loads(out.stdout)["models"]
    assert list(models) == ["sft", str(other)]
    assert models["sft"]["path"] == str(root / "sft" / "model")
    tasks = [[e["task"] for e in m["episodes"]] for m in models.values()]
    assert tasks[0] == tasks[1] and len(tasks[0]) == 2
    out = invoke("eval", "--compare", f"sft,{other}", "--recipe", root, "-v", *FAST)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["pass@1", "sft", str(other)]
    marks = [line.split()[1:] for line in lines[1:3]]           # one row per task
    assert [line.split()[0] for line in lines[1:3]] == tasks[0]
    overall = CELL.findall(next(line for line in lines if line.startswith("overall")))
    for column, (_, passed, n) in enumerate(overall):
        assert int(n) == 2 and int(passed) == sum(row[column] == "PASS" for row in marks)
    assert lines[-1].startswith(f"{other} − sft: ") and lines[-1].endswith(" points")


def test_an_unknown_model_name_says_what_was_tried(home, tmp_path):
    out = invoke("eval", "--compare", "sft,nope", "--recipe", tmp_path / "r", *FAST)
    assert out.exit_code == 2
    message = " ".join(out.output.split())
    assert "'sft' is not a model: tried" in message
    assert str(tmp_path / "r" / "sft" / "model") in message


def test_default_without_a_shipped_model_is_a_clear_error(home, recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_DEFAULT_MODEL", str(tmp_path / "missing"))
    out = invoke("eval", "--compare", "sft,default", "--recipe", recipe[0], *FAST)
    assert out.exit_code == 2
    assert f"no default model at {tmp_path / 'missing'}" in " ".join(out.output.split())


def test_compare_needs_two_different_models_and_no_model_option(home, recipe):
    root, other = recipe
    for args in (["--compare", "sft"], ["--compare", "sft,sft"],
                 ["--compare", f"sft,{other}", "--model", other]):
        out = invoke("eval", *args, "--recipe", root, *FAST)
        assert out.exit_code == 2 and "--compare" in out.output, args


def test_a_cheated_pass_is_not_counted(monkeypatch, tmp_path):
    from agent_runtime.policies.engine import EnginePolicy
    from learner import rollout
    from learner.recipe.evaluate import EvalConfig, evaluate_model

    def fake_episode(policy, task, store, **kwargs):
        cheated = task.family == "fix_bug"
        return rollout.Episode(task.id, "s", 0.0 if cheated else 1.0, True, cheated, 1, 5,
                               "finished", task.family, task.split)

    monkeypatch.setattr(EnginePolicy, "load", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(rollout, "run_episode", fake_episode)
    config = EvalConfig(n=4, processes=1, families=["fix_bug", "rename_symbol"])
    m = evaluate_model(tmp_path, config)
    assert m["by_family"] == {"fix_bug": {"passed": 0, "n": 2},
                              "rename_symbol": {"passed": 2, "n": 2}}
    assert m["pass_at_1"] == 0.5 and m["cheated"] == 2


def test_the_recipe_command_ends_with_the_same_table(home, tmp_path):
    sft = result([("a", "fix_bug", False), ("b", "rename", False)])
    grpo = result([("a", "fix_bug", True), ("b", "rename", False)])
    (tmp_path / "r" / "eval").mkdir(parents=True)
    (tmp_path / "r" / "eval" / "metrics.json").write_text(json.dumps(
        {"sft": sft, "grpo": grpo, "seconds": 3.0, "config": {}}))   # a finished eval stage
    out = invoke("learn", "recipe", "toy", "--out", tmp_path / "r", "--stages", "eval")
    assert out.exit_code == 0, out.output
    assert format_comparison({"sft": sft, "grpo": grpo}) in out.output
    assert "grpo − sft: +50.0 points" in out.output


def test_a_stage_asked_for_before_what_it_reads_is_one_line(home, tmp_path):
    out = invoke("learn", "recipe", "toy", "--out", tmp_path / "r", "--stages", "sft,grpo")
    assert out.exit_code == 1 and out.exception is not None
    assert "Error: stage sft reads the output of pretrain, sft_data" in out.output
    assert "Traceback" not in out.output and not (tmp_path / "r" / "sft").exists()


def test_a_broken_checkpoint_is_one_line_before_any_model_runs(home, recipe, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    out = CliRunner().invoke(main, ["eval", "--compare", f"sft,{broken}", "--recipe",
                                    str(recipe[0]), *map(str, FAST)])
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert out.exit_code == 1, out.output
    assert len(lines) == 1 and lines[0].startswith("Error: cannot load") and "not valid JSON" \
        in lines[0], lines


def test_processes_get_every_family_and_every_task_once():
    from learner.recipe.evaluate import EvalConfig, eval_tasks, shards
    tasks = eval_tasks(EvalConfig(n=60))
    parts = shards(tasks, 2)
    assert sorted(t.id for p in parts for t in p) == sorted(t.id for t in tasks)
    assert abs(len(parts[0]) - len(parts[1])) <= 1
    families = {t.family for t in tasks}
    assert len(families) == 6 and all({t.family for t in p} == families for p in parts)
    assert [t.id for t in shards(tasks, 2)[0]] == [t.id for t in parts[0]]   # fixed order
