"""The learner's commands, added to `apprentice` through the plugin hook (the runtime never
imports this package). Each command is a few lines over `learner` library calls; heavy
imports happen inside the commands."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

from agent_runtime.hooks import hookimpl
from learner.config import OptimConfig, PipelineConfig, RolloutConfig, TrainerConfig

# `learn grpo`'s defaults are the dataclasses' (learner.config imports nothing heavy)
_ROLLOUT, _TRAINER, _PIPELINE, _OPTIM = RolloutConfig(), TrainerConfig(), PipelineConfig(), OptimConfig()

if TYPE_CHECKING:
    from learner.recipe.evaluate import EvalConfig


@hookimpl
def register_commands(cli: click.Group) -> None:
    from learner.online_cli import add_commands
    cli.add_command(serve)
    cli.add_command(learn)
    cli.add_command(eval_command)
    add_commands(cli, learn)


@click.command()
@click.option("--store", "store_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Version store folder (default: $APPRENTICE_HOME/versions).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8750, show_default=True, help="Port to listen on.")
@click.option("--token", envvar="APPRENTICE_TOKEN", required=True,
              help="Bearer token clients must send (or set $APPRENTICE_TOKEN).")
def serve(store_dir: Path | None, host: str, port: int, token: str) -> None:
    """Serve policy versions (latest, deltas, snapshots, events) to connected runtimes."""
    from learner.server import serve as run_server
    from agent_runtime.store import default_home
    run_server(store_dir or Path(default_home()) / "versions", host=host, port=port, token=token)


# --- learn: training and its data (other learner commands join this group) ----------------

@click.group()
def learn() -> None:
    """Train the policy: simulated tasks, offline GRPO, online RL from your rated sessions."""


@learn.group()
def tasks() -> None:
    """Simulated coding tasks with hidden tests (generate, export as task folders)."""


def _families(value: str | None) -> list[str] | None:
    return [f.strip() for f in value.split(",") if f.strip()] if value else None


@tasks.command("export")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--split", type=click.Choice(["train", "heldout"]), default="train",
              show_default=True, help="Which split to draw from.")
@click.option("-n", "n", type=click.IntRange(1), default=20, show_default=True,
              help="How many instances (families taken in turn).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Generator seed; the same seed gives the same instances.")
@click.option("--families", metavar="A,B", help="Comma-separated families (default: all).")
@click.option("--difficulty", type=click.IntRange(1, 3), default=None,
              help="Only this difficulty (default: mixed 1-3).")
@click.option("--with-solution", is_flag=True,
              help="Also write solution.json (the oracle's plan) into each task folder.")
def export_tasks(out_dir: Path, split: str, n: int, seed: int, families: str | None,
                 difficulty: int | None, with_solution: bool) -> None:
    """Write generated task instances as task folders (task.json, repo/, tests/)."""
    from learner.tasks import export, generate
    try:
        instances = generate(split, n, seed=seed, families=_families(families),
                             difficulty=difficulty)
    except ValueError as exc:
        raise click.BadParameter(str(exc))
    folders = export(instances, out_dir, with_solution=with_solution)
    click.echo(f"wrote {len(folders)} task folders to {out_dir}")


# --- eval -----------------------------------------------------------------------------------

@click.command("eval")
@click.option("--tasks", "tasks_spec", default="sim-heldout", show_default=True,
              help="sim-heldout, sim-train, or a folder: one task folder or a folder of them.")
@click.option("-n", "n", type=click.IntRange(1), default=None,
              help="How many tasks (simulated: default 50; folders: default all).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Generator seed for simulated tasks.")
@click.option("--families", metavar="A,B", help="Comma-separated families (simulated tasks).")
@click.option("--model", default="default", show_default=True,
              help="Policy checkpoint: a model directory, or 'default' for the bundled one.")
@click.option("--policy", "policy_spec", metavar="SPEC",
              help="Overrides --model: 'oracle' (the scripted solver of simulated tasks) or a "
                   "policy spec such as 'replay:FILE'.")
@click.option("--compare", metavar="A,B", help="Instead of --model: evaluate these models on the "
              "same tasks (greedy, one episode each) and print pass@1 side by side. Each is "
              "'default', a recipe stage (pretrain, sft, rft, grpo: RECIPE/STAGE/model) or a "
              "checkpoint directory.")
@click.option("--recipe", "recipe_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Recipe folder the stage names of --compare refer to (default: "
                   "$APPRENTICE_HOME/recipes/default, where `learn recipe default` writes).")
@click.option("--processes", type=click.IntRange(1), default=None,
              help="With --compare: episode processes, each with its own model copy "
                   "(default: cores - 2, at least 1).")
@click.option("--max-steps", type=click.IntRange(1), default=20, show_default=True,
              help="Model calls allowed per task.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=512, show_default=True,
              help="Tokens per model call (512 is what the recipe's eval stage uses).")
@click.option("--context-window", type=click.IntRange(256), default=None,
              help="Run models with a smaller context window than their own, so episodes "
                   "summarize themselves sooner (e.g. 2048).")
@click.option("-j", "--concurrency", type=click.IntRange(1), default=None,
              help="Tasks run at once (default: 4 for the oracle, 8 for a model, whose "
                   "calls then decode as one batch; --compare uses --processes).")
@click.option("--sandbox", type=click.Choice(["auto", "off", "require"]), default=None,
              help="Run commands in bubblewrap (default: $APPRENTICE_SANDBOX, else auto).")
@click.option("--free-calls", is_flag=True,
              help="Let the model write tool calls of any form (malformed JSON, unknown tools "
                   "or arguments); by default the engine holds its calls' form.")
@click.option("--check-references", is_flag=True,
              help="Hold the calls' paths and edit_file's `old` and `new` to the workspace too "
                   "(AgentConfig.check_references); by default only their form is held.")
@click.option("--samples", type=click.IntRange(1), default=1, show_default=True,
              help="Episodes per task, sampled (needs --temperature > 0): pass@1 is then "
                   "their mean, and pass@K the share of tasks at least one of them solves.")
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="Sampling temperature of a model's calls (0: greedy).")
@click.option("--quantize", type=click.Choice(["int8"]), default=None,
              help="Decode with int8 copies of the model's weights (bf16 models).")
@click.option("--real-clock", is_flag=True,
              help="Let pytest in the tasks print real durations; by default its clock stands "
                   "still (\"in 0.00s\"), so evaluating a model twice gives the same episodes.")
@click.option("-v", "--verbose", is_flag=True, help="One line per task before the summary.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the numbers and per-task results as JSON instead.")
def eval_command(tasks_spec: str, n: int | None, seed: int, families: str | None, model: str,
                 policy_spec: str | None, compare: str | None, recipe_dir: Path | None,
                 processes: int | None, max_steps: int, max_new_tokens: int,
                 context_window: int | None, concurrency: int | None, sandbox: str | None,
                 free_calls: bool, check_references: bool, samples: int, temperature: float,
                 quantize: str | None,
                 real_clock: bool, verbose: bool, as_json: bool) -> None:
    """Evaluate a policy on held-out tasks: pass@1, mean steps and tokens per task; or several
    side by side (--compare sft,default)."""
    import json

    from agent_runtime.store import SessionStore
    from learner.eval import SIM_SETS, evaluate, format_report, policy_factory, resolve_tasks
    try:
        task_list = resolve_tasks(tasks_spec, n, seed, _families(families))
    except ValueError as exc:
        raise click.BadParameter(str(exc))
    if samples > 1 and temperature == 0.0:
        raise click.BadParameter("greedy episodes of a task repeat one another; sample with "
                                 "--temperature (e.g. 1.0)", param_hint="--samples")
    if compare is not None:
        if samples > 1 or temperature:
            raise click.BadParameter("it evaluates greedily, one episode a task",
                                     param_hint="--samples/--temperature")
        if policy_spec or model != "default":
            raise click.BadParameter("it names the models itself; leave out --model and "
                                     "--policy", param_hint="--compare")
        if quantize:
            raise click.BadParameter("evaluate one model at a time with --quantize",
                                     param_hint="--compare")
        from learner.recipe.evaluate import EvalConfig        # imports torch
        config = EvalConfig(n=len(task_list), split=SIM_SETS.get(tasks_spec, "heldout"),
                            folder="" if tasks_spec in SIM_SETS else tasks_spec, seed=seed,
                            families=_families(families), max_steps=max_steps,
                            max_new_tokens=max_new_tokens, processes=processes or 0,
                            sandbox=sandbox, context_window=context_window or 0,
                            constrain_calls=not free_calls,
                            check_references=check_references)
        _compare(compare, recipe_dir, config, verbose, as_json)
        return
    spec = policy_spec or model
    try:
        factory = policy_factory(spec, max_new_tokens, context_window or 0, temperature,
                                 quantize)
    except (OSError, ValueError) as exc:          # a missing or broken checkpoint: one line
        raise click.ClickException(f"cannot load policy {spec!r}: {exc}")
    if spec == "oracle" and any(t.solution is None for t in task_list):
        raise click.BadParameter("the oracle only solves generated tasks (or task folders "
                                 "exported with --with-solution)")
    with SessionStore() as store, _EvalProgress(len(task_list) * samples) as progress:
        report = evaluate(task_list, factory, store, max_steps=max_steps, sandbox=sandbox,
                          constrain_calls=not free_calls, check_references=check_references,
                          samples=samples,
                          concurrency=concurrency or (4 if spec == "oracle" else
                                                     1 if spec.startswith("replay:") else 8),
                          on_episode=progress.done, still_clock=not real_clock)
    click.echo(json.dumps(report.to_dict(), indent=1) if as_json
               else format_report(report, verbose=verbose))


class _EvalProgress:
    """`eval`'s progress on stderr while it runs (a terminal only; gone when it ends): episodes
    done of `total` and how many passed so far. `done` is called from the rollout threads."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
            TimeElapsedColumn
        self.passed, self.lock = 0, threading.Lock()
        console = Console(stderr=True)
        self.bar = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[passed]} passed"), TimeElapsedColumn(),
                            console=console, transient=True, disable=not console.is_terminal)
        self.task = self.bar.add_task("eval", total=total, passed=0)

    def __enter__(self) -> "_EvalProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def done(self, episode) -> None:
        with self.lock:
            self.passed += episode.reward > 0
            self.bar.update(self.task, advance=1, passed=self.passed)


def _compare(specs: str, recipe_dir: Path | None, config: EvalConfig, verbose: bool,
             as_json: bool) -> None:
    """`eval --compare`: every model on the same tasks (`config`) through `evaluate_model`."""
    import json

    from agent_runtime.store import default_home
    from learner.eval import format_comparison, resolve_model
    from learner.recipe.evaluate import evaluate_model
    names = _families(specs) or []
    if len(names) < 2 or len(set(names)) < len(names):
        raise click.BadParameter(f"name two or more different models, e.g. sft,default (got "
                                 f"{specs!r})", param_hint="--compare")
    recipe_dir = recipe_dir or Path(default_home()) / "recipes" / "default"
    from agent_runtime.policies import check_policy
    try:
        models = {name: resolve_model(name, recipe_dir) for name in names}
    except FileNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--compare")
    for name, path in models.items():                # a broken checkpoint: one line, first
        try:
            check_policy(str(path))
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"cannot load {name!r}: {exc}")
    results = {}
    for name, path in models.items():
        click.echo(f"evaluating {name} ({path}) on {config.n} tasks ...", err=True)
        results[name] = evaluate_model(path, config)
    if as_json:
        click.echo(json.dumps({"seed": config.seed, "models": {
            name: {"path": str(models[name]), **r} for name, r in results.items()}}, indent=1))
    else:
        click.echo(format_comparison(results, verbose=verbose))


# --- learn grpo / learn report ----------------------------------------------------------------

def _run_dir(run_dir: Path | None) -> Path:
    from agent_runtime.store import default_home
    return run_dir or Path(default_home()) / "runs" / "grpo"


def _task_spec(ctx, param, value: str) -> str:
    from learner.config import parse_task_spec
    try:
        parse_task_spec(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


@learn.command()
@click.option("--model", default="default", show_default=True,
              help="Starting checkpoint: a model directory, or 'default' for the bundled one.")
@click.option("--tasks", "family", default="sim", show_default=True, callback=_task_spec,
              help="Task family: simulated coding tasks ('sim', or e.g. "
                   "'sim:seed=3,phrasings=0.6' for other instances and composed wordings), or "
                   "'toy' (one model call, reward = share of tokens starting with a-m; a smoke "
                   "test).")
@click.option("--group", type=click.IntRange(2), default=_ROLLOUT.group_size, show_default=True,
              help="Episodes per task (G); advantages are relative to the group.")
@click.option("--steps", type=click.IntRange(1), default=_PIPELINE.steps, show_default=True,
              help="Optimizer steps in total (a resumed run counts on from its checkpoint).")
@click.option("--sync", is_flag=True, help="Alternate rollouts and training (no overlap).")
@click.option("--no-replay", is_flag=True, help="Let the router choose again in training "
                                                "instead of replaying the recorded experts.")
@click.option("--groups-per-step", type=click.IntRange(1), default=_PIPELINE.groups_per_step,
              show_default=True,
              help="Task groups in one training batch.")
@click.option("--lr", type=float, default=_OPTIM.lr, show_default=True, help="AdamW learning rate.")
@click.option("--iterations", type=click.IntRange(1), default=_TRAINER.iterations,
              show_default=True,
              help="Optimizer steps on each batch (GRPO's mu, TRL's num_iterations): the "
                   "passes after the first clip the ratio to the recorded behaviour.")
@click.option("--max-staleness", type=click.IntRange(0), default=_PIPELINE.max_staleness,
              show_default=True,
              help="Drop samples more than this many versions behind the trainer.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=_ROLLOUT.max_new_tokens,
              show_default=True, help="Tokens per model call in rollouts.")
@click.option("--max-steps", type=click.IntRange(1), default=_ROLLOUT.max_steps,
              show_default=True, help="Model calls per episode (simulated tasks).")
@click.option("--checkpoint-every", type=click.IntRange(1), default=_TRAINER.checkpoint_every,
              show_default=True,
              help="Write a resumable checkpoint every N steps.")
@click.option("--temperature", type=click.FloatRange(0, min_open=True),
              default=_TRAINER.temperature,
              show_default=True, help="Rollout sampling temperature.")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Run folder: checkpoints, metrics.db (default: $APPRENTICE_HOME/runs/grpo). "
                   "A folder with checkpoints resumes.")
@click.option("--versions", "versions_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Version store to publish to (default: $APPRENTICE_HOME/versions).")
@click.option("--seed", type=click.IntRange(0), default=_PIPELINE.seed, show_default=True,
              help="Task order and initial RNG seed.")
@click.option("--threads", type=click.IntRange(0), default=_PIPELINE.torch_threads,
              help="torch threads for the process (0 = torch's default).")
@click.option("--idle-threads", type=click.IntRange(0), default=_PIPELINE.idle_threads,
              help="Async with worker processes: the trainer's threads while no rollout is "
                   "queued or running (e.g. every core with --threads 1; 0 = off).")
@click.option("--backend", type=click.Choice(["local", "ray"]), default=_ROLLOUT.backend,
              show_default=True, help="Where async rollout workers run: local processes, or "
                                      "Ray actors (pip install 'apprentice[ray]').")
@click.option("--address", default=None,
              help="With --backend ray: the Ray cluster to join (e.g. HEAD:6379 or 'auto'); "
                   "default: $RAY_ADDRESS, else a new local Ray instance.")
@click.option("--workers", type=click.IntRange(1), default=_ROLLOUT.workers, show_default=True,
              help="Async rollout workers, each with its own policy copy.")
def grpo(model: str, family: str, group: int, steps: int, sync: bool, no_replay: bool,
         groups_per_step: int, lr: float, iterations: int, max_staleness: int, max_new_tokens: int,
         max_steps: int, checkpoint_every: int, temperature: float, run_dir: Path | None,
         versions_dir: Path | None, seed: int, threads: int, idle_threads: int, backend: str,
         address: str | None, workers: int) -> None:
    """Train with GRPO (router replay, async rollouts); rerun to resume after a kill."""
    import json

    from agent_runtime.policies import check_policy
    from agent_runtime.store import SessionStore, default_home
    from learner import config as c
    from learner.pipeline import build
    from learner.versions import VersionStore
    try:
        check_policy(model)                     # before the run folder exists
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load policy {model!r}: {exc}")
    run_dir = _run_dir(run_dir)
    cfg = c.RunConfig(
        model=model, tasks=family,
        trainer=c.TrainerConfig(optim=c.OptimConfig(lr=lr), router_replay=not no_replay,
                                temperature=temperature, seed=seed,
                                checkpoint_every=checkpoint_every, iterations=iterations),
        rollout=c.RolloutConfig(group_size=group, concurrency=group, max_new_tokens=max_new_tokens,
                                max_steps=max_steps, backend=backend, workers=workers),
        pipeline=c.PipelineConfig(mode="sync" if sync else "async", steps=steps,
                                  groups_per_step=groups_per_step, max_staleness=max_staleness,
                                  torch_threads=threads, idle_threads=idle_threads,
                                  seed=seed),
        ray=c.RayConfig(address=address))
    if backend == "ray":
        if sync:
            raise click.UsageError("--backend ray runs async rollouts; drop --sync")
        try:
            import ray  # noqa: F401
        except ImportError:
            raise click.ClickException("--backend ray needs ray: pip install 'apprentice[ray]'")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(c.to_dict(cfg), indent=1))
    versions = VersionStore(versions_dir or Path(default_home()) / "versions")
    with SessionStore() as store:
        try:
            pipe = build(cfg, run_dir, store, versions)
        except (FileNotFoundError, ValueError) as exc:
            raise click.ClickException(str(exc))
        t = pipe.trainer
        click.echo(f"{'resumed' if t.step_count else 'started'} {run_dir} at step "
                   f"{t.step_count}, version {t.version} ({cfg.pipeline.mode}"
                   f"{', ray' if backend == 'ray' else ''}, replay "
                   f"{'on' if cfg.trainer.router_replay else 'off'})")
        with click.progressbar(length=steps, label="grpo", show_pos=True,
                               item_show_func=lambda r: r and _progress_line(r)) as bar:
            bar.update(min(t.step_count, steps))
            pipe.run(on_step=lambda row: bar.update(1, row))
        s = pipe.stats
        click.echo(f"step {t.step_count}, version {t.version}: {s.episodes_trained} episodes "
                   f"trained in {s.wall_s:.0f}s, trainer idle {100 * s.idle_fraction:.0f}%; "
                   f"`apprentice learn report --run {run_dir}` plots the curves")


def _progress_line(row: dict) -> str:
    """One step's numbers; "-" for one the step did not measure (None, or NaN: e.g. the KL of
    a step whose groups all had equal rewards, so no token was trained)."""
    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None or value != value else format(value, fmt)
    return (f"v{row['version']} reward {f('reward_mean', '.3f')} pass {f('pass_rate', '.2f')} "
            f"kl {f('kl', '.1e')} flip {f('flip_rate', '.3f')}")


@learn.command()
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Run folder (default: $APPRENTICE_HOME/runs/grpo).")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG to write (default: RUN/report.png).")
def report(run_dir: Path | None, out: Path | None) -> None:
    """Plot a GRPO run's reward, pass-rate, KL and route-flip curves to a PNG."""
    from learner.report import load_metrics, write_report
    run_dir = _run_dir(run_dir)
    try:
        path = write_report(run_dir, out)
    except ValueError as exc:
        raise click.ClickException(str(exc))
    rows = load_metrics(run_dir)
    click.echo(f"{len(rows)} steps -> {path}; last: {_progress_line(rows[-1])}")


@learn.command("average")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.argument("models", nargs=-1, required=True)
@click.option("--weights", metavar="A,B", help="One weight per model (default: equal).")
def average(out: Path, models: tuple[str, ...], weights: str | None) -> None:
    """Write to OUT the mean of the MODELS' weights (checkpoints of one architecture, e.g. two
    GRPO runs from one start, or `default`): a model soup."""
    from agent_runtime.policies import resolve_model_path
    from learner.merge import average_checkpoints
    try:
        ws = [float(w) for w in weights.split(",")] if weights else None
        path = average_checkpoints([resolve_model_path(m) for m in models], out, ws)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"mean of {len(models)} checkpoints -> {path}")


# --- learn recipe: the default model, end to end ---------------------------------------------

@learn.command("recipe")
@click.argument("name", type=click.Choice(["default", "toy"]), default="default")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Recipe folder, one subfolder per stage (default: "
                   "$APPRENTICE_HOME/recipes/NAME). Rerun to resume.")
@click.option("--stages", metavar="A,B", help="Only these stages (tokenizer, corpus, "
                                              "pretrain, sft_data, sft, rft, grpo, eval).")
@click.option("--device", default="auto", show_default=True,
              help="Training and evaluation device: auto (cuda when present), cpu, cuda.")
@click.option("--eval-n", type=click.IntRange(1), default=None,
              help="Held-out tasks in the eval stage (default: the recipe's, 200).")
@click.option("-p", "--processes", type=click.IntRange(1), default=None,
              help="Processes collecting oracle episodes and running evaluation episodes.")
@click.option("--max-minutes", type=click.FloatRange(0), default=None,
              help="Wall-time cap of each training stage (pretrain, each SFT phase, grpo); "
                   "0 = none.")
@click.option("--ship", is_flag=True,
              help="Then make the newest model the package's default model "
                   "(agent_runtime/assets/default, with recipe.json: what made it).")
@click.option("--set", "settings", multiple=True, metavar="A.B=V",
              help="One field of the recipe's config, e.g. grpo.lr=1e-4 or "
                   "sft.train.max_seconds=3300 (repeatable; applied last).")
def recipe(name: str, out_dir: Path | None, stages: str | None, device: str,
           eval_n: int | None, processes: int | None, max_minutes: float | None,
           ship: bool, settings: tuple[str, ...]) -> None:
    """Make a default policy from scratch: tokenizer, pre-training, SFT, RFT, GRPO, eval."""
    from agent_runtime.store import default_home
    from learner.eval import format_comparison
    from learner.recipe import RECIPES, STAGES, run_recipe
    from learner.recipe.stages import MissingStage, check_stages, override
    config = RECIPES[name]()
    chosen = tuple(_families(stages) or STAGES)
    try:
        check_stages(chosen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--stages") from None
    config.pretrain.device = config.sft.device = config.grpo.device = config.eval.device = device
    if eval_n is not None:
        config.eval.n = eval_n
    if processes is not None:
        config.sft.workers = config.eval.processes = processes
    if max_minutes is not None:
        config.pretrain.train.max_seconds = config.sft.train.max_seconds = 60 * max_minutes
        config.sft.code.train.max_seconds = config.grpo.max_seconds = 60 * max_minutes
    for setting in settings:
        try:
            override(config, setting)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--set") from None
    out_dir = out_dir or Path(default_home()) / "recipes" / name
    try:
        results = run_recipe(out_dir, config, chosen, log=click.echo)
    except MissingStage as exc:
        raise click.ClickException(str(exc)) from None
    ev = {m: r for m, r in (results.get("eval") or {}).items()
          if isinstance(r, dict) and "pass_at_1" in r}
    if ev:
        click.echo(format_comparison(ev))
    click.echo(f"recipe folder: {out_dir}")
    if ship:
        from agent_runtime.policies import DEFAULT_MODEL_DIR
        from learner.recipe.ship import ship as ship_model
        src = ship_model(out_dir, DEFAULT_MODEL_DIR)
        click.echo(f"shipped {src} -> {DEFAULT_MODEL_DIR}")
