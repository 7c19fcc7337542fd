"""The recipe's stages, run in order with resume: tokenizer, corpus, pretrain, sft_data, sft,
rft, grpo, eval.

Each stage writes into its own folder under the recipe folder and ends by writing
`metrics.json` (its numbers, its wall time and its config). A stage whose `metrics.json`
exists is done and is skipped; a stage that was interrupted is run again, and the training
stages continue from their last `state.pt` (the GRPO stage from the learner's checkpoints),
so rerunning the same command resumes the recipe. Checkpoints are HF-format folders
(`pretrain/model`, `sft/model`, `rft/model`, `grpo/model`) with the tokenizer and chat
template inside.

It does not define what a stage computes (the stage modules do) or parse command lines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from learner.eval import MODEL_STAGES
from learner.recipe.evaluate import EvalConfig, evaluate_model
from learner.recipe.lm import write_json
from learner.recipe.pretrain import PretrainConfig
from learner.recipe.rft import RFTConfig
from learner.recipe.sft import SFTConfig
from learner.recipe.tokenizer_stage import TokenizerConfig

STAGES = ("tokenizer", "corpus", "pretrain", "sft_data", "sft", "rft", "grpo", "eval")
NEEDS = {"corpus": ("tokenizer",), "pretrain": ("tokenizer", "corpus"), "sft_data": ("tokenizer",),
         "sft": ("pretrain", "sft_data"), "rft": ("sft", "sft_data"), "grpo": ("sft",),
         "eval": ("sft",)}                  # the stages whose output a stage reads
OUTPUT = {"tokenizer": "tokenizer/tokenizer.tiktoken", "corpus": "corpus/corpus.npz",
          "pretrain": "pretrain/model/config.json", "sft_data": "sft_data/data.npz",
          "sft": "sft/model/config.json"}  # what it reads of each


@dataclass
class GRPOStageConfig:
    steps: int = 40                 # optimizer steps
    group_size: int = 8             # episodes per task (G)
    groups_per_step: int = 2        # task groups per training batch
    lr: float = 2e-5                # AdamW learning rate
    iterations: int = 1             # optimizer steps on each batch (`TrainerConfig.iterations`)
    temperature: float = 1.0        # rollout sampling temperature
    max_new_tokens: int = 400       # per model call in rollouts
    max_steps: int = 10             # model calls per episode
    workers: int = 6                # rollout workers (policy copies), async pipeline
    max_seconds: float = 300.0      # stop after this wall time (0 = no limit)
    device: str = "auto"            # trainer and rollout device
    seed: int = 0
    curriculum: bool = True         # draw task families the model both passes and fails
                                    # (`learner.curriculum`): most groups otherwise train nothing
    task_seed: int | None = None    # generator seed of the training tasks (None: `seed`, the
                                    # SFT data's own first instances; another seed: fresh ones)
    phrasings: float = 0.0          # share of them with composed instructions (wordings SFT
                                    # did not see; `learner.tasks.generate`)
    revisit: float = 0.0            # share of draws that rerun a task whose last group was
                                    # mixed (`PipelineConfig.revisit`; 0: off)
    max_skipped: int = 0            # groups with one reward throughout set aside per step
                                    # (`PipelineConfig.max_skipped`; 0: off)
    families: tuple[str, ...] = ()  # task families the stage draws from (empty: all), e.g. the
                                    # ones that come back mixed at its temperature
    task_count: int = 0             # training instances (0: the pipeline's pool): a few, drawn
                                    # again and again, check that GRPO raises their pass rate
    partial_credit: float = 0.0     # a failed episode's reward: this times the share of its
                                    # tests passing (`RolloutConfig.partial_credit`; 0: off)
    oracle_start: float = 0.0       # share of groups started after some of the oracle's turns
                                    # (`RolloutConfig.oracle_start`; 0: off)
    slip_start: float = 0.0         # share of groups started after one of the oracle's calls
                                    # played with a slip (`RolloutConfig.slip_start`; 0: off)
    guide: float = 0.0              # share of the groups with no pass given the oracle's
                                    # episode as one more member (`RolloutConfig.guide`; 0: off)
    guided_failures: bool = True    # a guided group's failures train too
                                    # (`LossConfig.guided_failures`; False: its guide only)
    guide_weight: float = 1.0       # weight of a guide token's term (`LossConfig.guide_weight`)
    guide_shaping: float = 0.0      # gamma of LUFFY's shaping of a guide token's term,
                                    # p / (p + gamma) (`LossConfig.guide_shaping`; 0: off)
    stop_after_failed_checks: int = 0  # end an episode at this many failed checks after
                                    # its first change (`RolloutConfig.stop_after_failed_checks`)
    check_references: bool = True   # rollouts' calls held to the workspace too
                                    # (`RolloutConfig.check_references`)
    kl_coef: float = 0.0            # weight of a k3 KL penalty to the stage's starting weights
                                    # (`LossConfig.kl_coef`; 0: off, no reference model kept)
    balance: bool = False           # a step's negative-advantage tokens weigh what its positive
                                    # ones do (`LossConfig.balance`): failed episodes run longer,
                                    # and unweighted their tokens outvote the passes
    trainable: tuple[str, ...] = () # regexes of the parameters that train (`TrainerConfig.
                                    # trainable`; empty: all), e.g. `learner.online.TRAINABLE`
    average: float = 0.0            # the stage's model: the mean of the policy's weights over
                                    # this last share of its versions (`averaged_versions`;
                                    # 0: the final weights)
    runs: int = 1                   # independent runs from the start, run i on the pool of
                                    # task_seed + i (each with `steps` and `max_seconds`); the
                                    # stage's model is the mean of their models (WARP's merge)
    start_share: float = 0.0        # the start's weight in that mean, the runs sharing the
                                    # rest (WARP's interpolation towards the initialization;
                                    # 0: the runs' mean alone; RUNS.md, "The same twenty
                                    # minutes twice more")


@dataclass
class RecipeConfig:
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    grpo: GRPOStageConfig = field(default_factory=GRPOStageConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    total_minutes: float = 0.0      # the whole recipe's wall time (0: none): a training
                                    # stage's budget shrinks to what is left of it after the
                                    # stages before and the budgets after (`fit_budget`)
    reserve_seconds: float = 600.0  # what that keeps for the work no budget holds after the
                                    # stage (scoring, averaging, saving, the eval stage)


# The training budgets `fit_budget` can shrink, as (stage, path of the field in the config)
BUDGETS = (("pretrain", ("pretrain", "train")), ("sft", ("sft", "train")),
           ("sft", ("sft", "code", "train")), ("grpo", ("grpo",)))


def override(config: RecipeConfig, setting: str) -> None:
    """Set one field of `config` from "SECTION.FIELD=VALUE" (dotted to any depth, e.g.
    "grpo.lr=1e-4", "sft.train.max_seconds=3300", "grpo.trainable=\\.mlp\\.experts\\.";
    what `--set` takes, as Hydra's overrides do in veRL). The value is read as the field's
    current type: numbers, true/false, comma-separated tuples, None for "none". ValueError
    names a field that does not exist or a value that does not fit."""
    import dataclasses
    path, sep, raw = setting.partition("=")
    names = path.strip().split(".")
    if not sep or not all(names):
        raise ValueError(f"--set takes SECTION.FIELD=VALUE, got {setting!r}")
    target = config
    for name in names[:-1]:
        target = getattr(target, name, None)
        if not dataclasses.is_dataclass(target):
            raise ValueError(f"{path}: {name!r} is not a section of the recipe's config")
    field_names = {f.name for f in dataclasses.fields(target)}
    if names[-1] not in field_names:
        raise ValueError(f"{path}: no field {names[-1]!r} (fields: {', '.join(sorted(field_names))})")
    current, raw = getattr(target, names[-1]), raw.strip()
    try:
        if raw.lower() == "none":
            value = None
        elif isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            value = raw.lower() in ("true", "1")
        elif isinstance(current, (tuple, list)):
            value = type(current)(x.strip() for x in raw.split(",") if x.strip())
        elif current is None:
            value = json.loads(raw) if raw[:1] in "0123456789-[{\"" else raw
        else:
            value = type(current)(raw)
    except ValueError:
        raise ValueError(f"{path}: {raw!r} is not a valid {type(current).__name__}") from None
    setattr(target, names[-1], value)


def stage_done(out: Path, stage: str) -> dict | None:
    path = out / stage / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def check_stages(stages: tuple[str, ...]) -> None:
    """ValueError naming the stages that are not the recipe's (a typo would skip them)."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown recipe stage(s): {', '.join(unknown)}; the stages are "
                         f"{', '.join(STAGES)}")


class MissingStage(ValueError):
    """A stage was asked for before the stages it reads from are done."""


def check_needs(out: Path, stage: str) -> None:
    """MissingStage naming what `stage` reads that `out` does not have yet."""
    missing = [s for s in NEEDS.get(stage, ()) if not (out / OUTPUT[s]).exists()]
    if missing:
        raise MissingStage(
            f"stage {stage} reads the output of {', '.join(missing)}, which {out} does not have "
            f"(no {OUTPUT[missing[0]]}): add {', '.join(missing)} to the stages, or run the "
            f"whole recipe")


class StageClock:
    """A stage's wall time over every process that ran it: the seconds recorded in `path` by
    the processes before this one, plus this one's, written back every `every` seconds. A
    stage that is killed and run again (the recipe resumes) so reports the time it took in
    all, less at most `every` seconds of the process that was killed."""

    def __init__(self, path: Path, every: float = 10.0):
        self.path = path
        self.before = json.loads(path.read_text())["seconds"] if path.exists() else 0.0
        self.t0 = time.time()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(every,), daemon=True)
        self._thread.start()

    def seconds(self) -> float:
        return self.before + time.time() - self.t0

    def _tick(self, every: float) -> None:
        while not self._done.wait(every):
            self._write()

    def _write(self) -> float:
        seconds, tmp = self.seconds(), self.path.with_suffix(".tmp")
        write_json(tmp, {"seconds": seconds})
        os.replace(tmp, self.path)
        return seconds

    def stop(self) -> float:
        """Stop ticking, write the total and return it."""
        self._done.set()
        self._thread.join()
        return self._write()


def _budget(config, path: tuple[str, ...]):
    target = config
    for name in path:
        target = getattr(target, name)
    return target


def fit_budget(config: RecipeConfig, out: Path, stage: str,
               stages: tuple[str, ...]) -> tuple[RecipeConfig, float | None]:
    """`config` with `stage`'s first training budget cut to what the whole recipe's
    `total_minutes` leaves it: less the seconds of the stages done in `out`, the budgets of the
    training after it (its own later phases, the later stages in `stages` not done yet) and
    `reserve_seconds`; at least a minute. Returns the config (unchanged when the budget fits
    or there is no whole-recipe budget) and the budget fitted (None when none was cut). A
    machine slower than the one the budgets were set on so spends the stages' time where
    the recipe is still running, and the recipe keeps its wall time; where every stage
    keeps to its own budget, nothing changes."""
    import copy
    own = [path for s, path in BUDGETS if s == stage]
    if not config.total_minutes or not own:
        return config, None
    done = {s: stage_done(out, s) for s in STAGES if s != stage}
    spent = sum(m["seconds"] for m in done.values() if m is not None)
    later = [path for s, path in BUDGETS if s != stage and s in stages
             and STAGES.index(s) > STAGES.index(stage) and done[s] is None]
    later_seconds = sum(_budget(config, p).max_seconds * (config.grpo.runs if p == ("grpo",) else 1)
                        for p in own[1:] + later)
    left = 60 * config.total_minutes - spent - later_seconds - config.reserve_seconds
    if own[0] == ("grpo",):
        left /= config.grpo.runs                      # each run has the budget
    first = _budget(config, own[0])
    if first.max_seconds and first.max_seconds <= left:
        return config, None
    fitted = max(60.0, left)
    config = copy.deepcopy(config)
    _budget(config, own[0]).max_seconds = fitted
    return config, fitted


def run_recipe(out: Path, config: RecipeConfig, stages: tuple[str, ...] = STAGES,
               log: Callable[[str], None] = print) -> dict[str, dict]:
    """Run `stages` (in recipe order) into `out`, skipping finished ones; returns metrics."""
    check_stages(stages)
    out = Path(out)
    results: dict[str, dict] = {}
    for stage in STAGES:
        if stage not in stages:
            continue
        done = stage_done(out, stage)
        if done is not None:
            log(f"[{stage}] done already ({done.get('seconds', 0):.0f}s); skipped")
            results[stage] = done
            continue
        check_needs(out, stage)
        clock = StageClock(out / stage / "clock.json")
        log(f"[{stage}] running" + (f" (resumed after {clock.before:.0f}s)" if clock.before else ""))
        fitted, budget = fit_budget(config, out, stage, stages)
        if budget is not None:
            log(f"[{stage}] budget cut to {budget:.0f}s: what the recipe's "
                f"{config.total_minutes:g} minutes leave it")
        try:
            metrics = RUNNERS[stage](out, fitted, lambda row, s=stage: log(f"[{s}] {_fmt(row)}"))
        finally:
            seconds = clock.stop()
        metrics["seconds"] = seconds
        if clock.before:
            metrics["seconds_before_resume"] = clock.before
        if budget is not None:
            metrics["budget_fitted_s"] = budget
        metrics["config"] = _stage_config(fitted, stage)
        write_json(out / stage / "metrics.json", metrics)
        log(f"[{stage}] finished in {metrics['seconds']:.0f}s: {_fmt(_headline(metrics))}")
        results[stage] = metrics
    return results


def _fmt(row: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _headline(m: dict) -> dict:
    return {k: v for k, v in m.items() if not isinstance(v, (dict, list))}


def _stage_config(config: RecipeConfig, stage: str) -> dict:
    part = {"tokenizer": config.tokenizer, "corpus": config.pretrain, "pretrain": config.pretrain,
            "sft_data": config.sft, "sft": config.sft, "rft": config.rft, "grpo": config.grpo,
            "eval": config.eval}
    return asdict(part[stage])


# -- the stages ---------------------------------------------------------------------------------

def _tokenizer(out: Path, config: RecipeConfig, log) -> dict:
    from learner.recipe import tokenizer_stage
    return tokenizer_stage.run(out / "tokenizer", config.tokenizer)


def _corpus(out: Path, config: RecipeConfig, log) -> dict:
    from agent_runtime.model import load_tokenizer
    from learner.recipe.pretrain import encode_corpus
    from learner.recipe.tokenizer_stage import corpus_files
    files = corpus_files(max_file_bytes=config.tokenizer.max_file_bytes)
    return encode_corpus(load_tokenizer(out / "tokenizer"), files, config.pretrain,
                         out / "corpus" / "corpus.npz")


def _pretrain(out: Path, config: RecipeConfig, log) -> dict:
    from learner.recipe import pretrain
    return pretrain.run(out / "tokenizer", out / "corpus" / "corpus.npz", out / "pretrain",
                        config.pretrain, log)


def _sft_data(out: Path, config: RecipeConfig, log) -> dict:
    from learner.recipe import sft
    metrics = sft.collect(out / "tokenizer", out / "sft_data" / "data.npz", config.sft)
    if config.sft.code.tasks:
        metrics["code"] = sft.collect_code(out / "tokenizer", out / "sft_data" / "code.npz",
                                           config.sft)
    if config.sft.heldout_tasks:
        metrics["heldout"] = sft.collect(out / "tokenizer", out / "sft_data" / "heldout.npz",
                                         config.sft, split="heldout",
                                         tasks=config.sft.heldout_tasks)
    return metrics


def _sft(out: Path, config: RecipeConfig, log) -> dict:
    import numpy as np

    from agent_runtime.model import load_model
    from learner.recipe import sft
    from learner.recipe.pretrain import copy_probe
    data = out / "sft_data" / "data.npz"
    code = config.sft.code
    if not code.tasks:
        metrics = sft.run(out / "pretrain" / "model", data, out / "sft", config.sft, log)
    else:       # two phases: sft/base/model, then it with the code episodes -> sft/model
        episodes = out / "sft_data" / "code.npz"
        if not episodes.exists():               # before the first phase's hour, not after it
            raise FileNotFoundError(
                f"{episodes} is missing: sft.code.tasks is {code.tasks} but the sft_data stage "
                f"collected no code episodes; delete {out / 'sft_data' / 'metrics.json'} and "
                f"run the sft_data stage again")
        if not 0 <= code.base_share < 1:
            raise ValueError(f"sft.code.base_share is a share in [0, 1), not {code.base_share}")
        base = out / "sft" / "base"
        done = base / "metrics.json"
        if done.exists():
            metrics = json.loads(done.read_text())
        else:
            metrics = sft.run(out / "pretrain" / "model", data, base, config.sft, log)
            write_json(done, metrics)
        second = out / "sft" / "code" if code.base_share else out / "sft"
        metrics["code"] = sft.run(base / "model", [data, episodes],
                                  second, replace(config.sft, train=code.train), log)
        if code.base_share:
            from learner.merge import average_checkpoints
            average_checkpoints([second / "model", base / "model"], out / "sft" / "model",
                                [1 - code.base_share, code.base_share])
            metrics["code"]["base_share"] = code.base_share
    heldout = np.load(out / "corpus" / "corpus.npz")["heldout"]
    model = load_model(out / "sft" / "model", dtype="float32")
    metrics["copy_probe"] = copy_probe(model, heldout)
    episodes = out / "sft_data" / "heldout.npz"
    if episodes.exists():
        metrics["heldout"] = sft.assistant_metrics(model, sft.load_sequences(episodes),
                                                   config.sft.max_len)
    return metrics


def _rft(out: Path, config: RecipeConfig, log) -> dict:
    """Expert iteration (`learner.recipe.rft`) from the SFT checkpoint: the model's own honest
    passes on fresh training tasks, mixed with the stage `sft_data`'s oracle sequences."""
    from learner.recipe import rft
    if config.rft.rounds == 0:                  # off: GRPO and eval take the SFT model
        return {"rounds": [], "tasks": 0}
    metrics = rft.run(out / "sft" / "model", out / "rft", config.rft,
                      oracle=out / "sft_data" / "data.npz", log=log)
    got = [r["collect"] for r in metrics["rounds"]]
    metrics["passed"] = "+".join(str(g["passed"]) for g in got)     # per round, for the log
    metrics["tasks"] = sum(g["tasks"] for g in got)
    return metrics


def _start(out: Path) -> Path:
    """The checkpoint GRPO starts from: expert iteration's when it ran, else SFT's."""
    rft = out / "rft" / "model"
    return rft if (rft / "config.json").exists() else out / "sft" / "model"


def grpo_tasks(g: GRPOStageConfig) -> str:
    """The pipeline's task spec for the stage (`learner.pipeline.task_family`)."""
    if g.task_seed is None and not g.phrasings and not g.families and not g.task_count:
        return "sim"
    seed = g.seed if g.task_seed is None else g.task_seed
    families = f",families={'+'.join(g.families)}" if g.families else ""
    count = f",count={g.task_count}" if g.task_count else ""
    return f"sim:seed={seed},phrasings={g.phrasings}{families}{count}"


def grpo_run_config(g: GRPOStageConfig, start: Path, device: str):
    """The learner's `RunConfig` for the stage, from checkpoint `start` on `device`."""
    from learner import config as lc
    cores = len(os.sched_getaffinity(0)) if device == "cpu" else 0
    return lc.RunConfig(
        model=str(start), tasks=grpo_tasks(g),
        trainer=lc.TrainerConfig(loss=lc.LossConfig(kl_coef=g.kl_coef, balance=g.balance,
                                                        guided_failures=g.guided_failures,
                                                        guide_weight=g.guide_weight,
                                                        guide_shaping=g.guide_shaping),
                                 optim=lc.OptimConfig(lr=g.lr), router_replay=True,
                                 temperature=g.temperature, device=device, seed=g.seed,
                                 checkpoint_every=5, precision="auto",
                                 trainable=tuple(g.trainable), iterations=g.iterations),
        rollout=lc.RolloutConfig(group_size=g.group_size, concurrency=g.group_size,
                                 max_new_tokens=g.max_new_tokens, max_steps=g.max_steps,
                                 workers=g.workers, partial_credit=g.partial_credit,
                                 oracle_start=g.oracle_start, slip_start=g.slip_start,
                                 guide=g.guide,
                                 stop_after_failed_checks=g.stop_after_failed_checks,
                                 check_references=g.check_references),
        pipeline=lc.PipelineConfig(mode="async", steps=g.steps, groups_per_step=g.groups_per_step,
                                   seed=g.seed, curriculum=g.curriculum,
                                   max_skipped=g.max_skipped, revisit=g.revisit,
                                   # on a CPU: one core trains while one rolls out, and
                                   # the trainer takes every core while no rollout runs
                                   torch_threads=min(cores, 1), idle_threads=cores))


def averaged_versions(last: int | None, share: float) -> list[int]:
    """The versions whose mean is the GRPO stage's model: the last `share` of versions 1..last
    (version 1 is the starting weights, so a share of 1 averages from the start), at least the
    last one. Averaging a run's weights along its trajectory (SWA; WARP) keeps what its steps
    agree on and cancels much of their noise (README, "Weight averaging")."""
    if not last:
        return []
    first = last - int(share * (last - 1)) if share > 0 else last
    return list(range(max(1, first), last + 1))


def load_mean(model, versions, which: list[int]) -> None:
    """Load the mean of versions `which` of store `versions` (states as the trainer publishes
    them) into `model`'s weights; a tied output head stays tied to the embeddings."""
    mean = versions.mean(which)
    own = model.state_dict()
    misfit = sorted(k for k, v in mean.items() if k not in own or own[k].shape != v.shape)
    if misfit:
        raise ValueError(f"versions {which[0]}-{which[-1]} are not this model's weights: "
                         f"{misfit[:3]} missing or of another shape")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in mean.items()}, strict=False)


def _grpo(out: Path, config: RecipeConfig, log) -> dict:
    """GRPO with the learner's pipeline (router replay on) from the RFT (else SFT) checkpoint;
    with `runs` > 1, that many independent runs from it on different pools, averaged."""
    from learner.merge import average_checkpoints
    from learner.recipe.pretrain import pick_device

    g = config.grpo
    if g.runs < 1:
        raise ValueError(f"grpo.runs must be at least 1, not {g.runs}")
    if not 0 <= g.start_share < 1:
        raise ValueError(f"grpo.start_share is a share in [0, 1), not {g.start_share}")
    device = pick_device(g.device)
    start = _start(out)
    if g.runs == 1 and not g.start_share:
        return _grpo_run(g, start, out / "grpo", device, log)
    base = g.seed if g.task_seed is None else g.task_seed
    runs = []
    for i in range(g.runs):
        folder = out / "grpo" / f"run{i}"
        done = folder / "metrics.json"
        if done.exists():                 # finished before a stop: kept, not run again
            runs.append(json.loads(done.read_text()))
            log({"run": i, "done_already": True})
            continue
        log({"run": i, "task_seed": base + i})
        metrics = _grpo_run(replace(g, task_seed=base + i, seed=g.seed + i), start, folder,
                            device, lambda row, i=i: log({"run": i, **row}))
        write_json(done, metrics)
        runs.append(metrics)
    parts = [out / "grpo" / f"run{i}" / "model" for i in range(g.runs)]
    weights = [(1 - g.start_share) / g.runs] * g.runs
    if g.start_share:
        parts, weights = parts + [start], weights + [g.start_share]
    average_checkpoints(parts, out / "grpo" / "model", weights)
    log({"averaged_runs": g.runs, "start_share": g.start_share})
    return {"runs": runs, "device": device, "start_share": g.start_share,
            **{k: sum(r[k] for r in runs) for k in ("steps", "episodes_trained", "wall_s")}}


def _grpo_run(g: GRPOStageConfig, start: Path, folder: Path, device: str, log) -> dict:
    """One GRPO run from checkpoint `start` into `folder` (run/, home/, versions/, model/);
    resumes from the run's own checkpoint when it has one."""
    from agent_runtime.policies.engine import EnginePolicy
    from agent_runtime.model import save_model
    from agent_runtime.store import SessionStore
    from learner.pipeline import build
    from learner.recipe.pretrain import MAX_SHARD_BYTES, copy_tokenizer
    from learner.versions import VersionStore

    run_dir = folder / "run"
    cfg = grpo_run_config(g, start, device)
    run_dir.mkdir(parents=True, exist_ok=True)

    def factory():
        return EnginePolicy.load(str(start), dtype="bfloat16", device=device,
                                 temperature=g.temperature, max_new_tokens=g.max_new_tokens)

    with SessionStore(folder / "home") as store:
        pipe = build(cfg, run_dir, store, VersionStore(folder / "versions"), factory)
        clock = StageClock(run_dir / "clock.json")  # training's seconds over every process:
        left = max(0.0, g.max_seconds - clock.before) if g.max_seconds else None  # the budget
        try:
            stats = pipe.run(max_seconds=left,
                             on_step=lambda row: log({k: row.get(k) for k in (
                                 "step", "version", "reward_mean", "pass_rate", "kl",
                                 "flip_rate") if row.get(k) is not None}))
        finally:
            clock.stop()
        trainer = pipe.trainer
        trainer.save_checkpoint({"cursor": pipe.cursor})
        model = trainer.model.to("cpu")
        averaged = averaged_versions(trainer.version, g.average)
        if len(averaged) > 1:        # after the checkpoint: the trainer resumes from its own
            load_mean(model, VersionStore(folder / "versions"), averaged)
            log({"averaged_versions": [averaged[0], averaged[-1]]})
        save_model(model, folder / "model", dtype="bfloat16", max_shard_bytes=MAX_SHARD_BYTES)
        copy_tokenizer(start, folder / "model")
        rows = trainer.metrics()
    passes = [r["pass_rate"] for r in rows if r.get("pass_rate") is not None]
    return {"steps": trainer.step_count, "version": trainer.version, "device": device,
            "task_seed": g.task_seed, "averaged_versions": averaged,
            "episodes_trained": stats.episodes_trained, "wall_s": stats.wall_s,
            "train_pass_rate_first": passes[0] if passes else None,
            "train_pass_rate_last": passes[-1] if passes else None,
            "history": rows}


def _eval(out: Path, config: RecipeConfig, log) -> dict:
    """Held-out pass@1 of the SFT, RFT and GRPO checkpoints, side by side."""
    result = {}
    for name in MODEL_STAGES[MODEL_STAGES.index("sft"):]:       # the task-trained ones
        model = out / name / "model"
        if (model / "config.json").exists():
            m = evaluate_model(model, config.eval)
            log({"model": name, "pass_at_1": m["pass_at_1"], "n": m["n"]})
            result[name] = m
    window = config.eval.summary_window
    if window and result:
        name = list(result)[-1]
        m = evaluate_model(out / name / "model", replace(config.eval, context_window=window))
        log({"model": name, "context_window": window, "pass_at_1": m["pass_at_1"], "n": m["n"]})
        result[f"{name}_window_{window}"] = m
    return result


RUNNERS = {"tokenizer": _tokenizer, "corpus": _corpus, "pretrain": _pretrain,
           "sft_data": _sft_data, "sft": _sft, "rft": _rft, "grpo": _grpo, "eval": _eval}
