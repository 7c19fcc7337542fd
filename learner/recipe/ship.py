"""Ship a recipe's newest checkpoint as the package's default model.

`ship(recipe_dir, dest)` replaces `dest` (normally `agent_runtime/assets/default/`, which
`load_policy("default")` reads) with the last trained stage's model folder (weights, config,
tokenizer) and writes `dest/recipe.json`: what made it, stage by stage, without the per-step
histories (times, steps, losses, perplexity, copy probe, held-out pass@1 when evaluated).

It does not train or evaluate anything; it refuses a folder with no trained model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from learner.eval import MODEL_STAGES
from learner.recipe.stages import STAGES

DROPPED = ("history", "config")                  # per-step rows and full configs stay in the run


def newest_model(recipe_dir: Path) -> Path:
    for stage in reversed(MODEL_STAGES):                    # the newest first
        if (recipe_dir / stage / "model" / "config.json").exists():
            return recipe_dir / stage / "model"
    raise FileNotFoundError(f"{recipe_dir}: no trained model (none of {', '.join(MODEL_STAGES)}/model)")


def _without_histories(value):
    """`value` with every DROPPED key taken out, at any depth (a GRPO stage of several
    runs keeps each run's metrics, history included, in a list)."""
    if isinstance(value, dict):
        return {k: _without_histories(v) for k, v in value.items() if k not in DROPPED}
    if isinstance(value, list):
        return [_without_histories(v) for v in value]
    return value


def summary(recipe_dir: Path) -> dict:
    """Each finished stage's metrics without their histories and configs."""
    out = {}
    for stage in STAGES:
        path = recipe_dir / stage / "metrics.json"
        if path.exists():
            out[stage] = _without_histories(json.loads(path.read_text()))
    return out


def ship(recipe_dir: Path, dest: Path) -> Path:
    """Copy the newest model of `recipe_dir` to `dest` (replacing it); returns the source."""
    src = newest_model(recipe_dir)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    record = {"model": f"{src.parent.name}/model", "stages": summary(recipe_dir)}
    (tmp / "recipe.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return src
