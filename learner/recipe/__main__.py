"""`python -m learner.recipe`: the recipe without the installed `apprentice` entry point.

    python -m learner.recipe default --out DIR [--stages pretrain,sft] [--budgets 150,70,45,50]
                                     [--export DIR2] [--workers N] [--processes N]
                                     [--set grpo.lr=1e-4 --set grpo.max_skipped=4 ...]

For machines where the package is on PYTHONPATH but not installed (a rented GPU box).
`--budgets` sets the wall-time caps of pretrain, sft, grpo (seconds) and the per-process
eval cap; `--export` writes the newest checkpoint's weight shards (at most 15 MiB each) and one
`meta.tar.gz` (metrics, config, tokenizer) into a folder. Everything else is
`apprentice learn recipe`.
"""

from __future__ import annotations

import argparse
import shutil
import tarfile
from pathlib import Path

from learner.recipe import RECIPES, STAGES, run_recipe
from learner.recipe.ship import newest_model
from learner.recipe.stages import MissingStage, check_stages, override


def export(out: Path, dest: Path) -> list[Path]:
    """`dest/meta.tar.gz` (every stage's metrics, the model's config and tokenizer files) and
    the weight shards of the last trained model, flat: few files, none over 16 MiB."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        model = newest_model(out)
    except FileNotFoundError:
        model = None
    shards = sorted(model.glob("*.safetensors")) if model is not None else []
    written = [Path(shutil.copy2(f, dest / f.name)) for f in shards]
    with tarfile.open(dest / "meta.tar.gz", "w:gz") as tar:
        for stage in STAGES:
            if (out / stage / "metrics.json").exists():
                tar.add(out / stage / "metrics.json", f"{stage}/metrics.json")
        for f in sorted(model.iterdir()) if model is not None else []:
            if f not in shards:
                tar.add(f, f"{model.parent.name}/model/{f.name}")
    return written + [dest / "meta.tar.gz"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=sorted(RECIPES))
    ap.add_argument("--out", type=Path, required=True, help="recipe folder (rerun to resume)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--budgets", help="seconds: pretrain,sft,grpo,eval-per-process")
    ap.add_argument("--export", type=Path, help="copy metrics and the last model here")
    ap.add_argument("--workers", type=int, help="GRPO rollout workers (policy copies)")
    ap.add_argument("--processes", type=int,
                    help="processes collecting oracle episodes and running eval episodes")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="A.B=V",
                    help="one field of the recipe's config, e.g. grpo.lr=1e-4 (repeatable)")
    args = ap.parse_args()
    config = RECIPES[args.name]()
    config.pretrain.device = config.sft.device = config.grpo.device = config.eval.device = args.device
    if args.budgets:
        b = [float(x) for x in args.budgets.split(",")]
        config.pretrain.train.max_seconds, config.sft.train.max_seconds = b[0], b[1]
        config.grpo.max_seconds, config.eval.max_seconds = b[2], b[3]
    if args.workers:
        config.grpo.workers = args.workers
    if args.processes:
        config.sft.workers = config.eval.processes = args.processes
    for setting in args.settings:
        try:
            override(config, setting)
        except ValueError as exc:
            ap.error(str(exc))
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    try:
        check_stages(stages)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        run_recipe(args.out, config, stages)
    except MissingStage as exc:
        ap.error(str(exc))
    if args.export:
        for path in export(args.out, args.export):
            print(f"exported {path}")


if __name__ == "__main__":
    main()
