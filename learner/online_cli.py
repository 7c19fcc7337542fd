"""Commands of learning from use: `learn online`, `learn status`, `daemon`, `versions`.
Each is a few lines over `learner.online`, `learner.daemon` and `learner.versions`; heavy
imports happen inside the commands. `learner.cli` adds them to `apprentice`."""

from __future__ import annotations

import json
from pathlib import Path

import click


def add_commands(cli: click.Group, learn: click.Group) -> None:
    learn.add_command(online)
    learn.add_command(status)
    cli.add_command(daemon)
    cli.add_command(versions)


def _model_option(fn):
    return click.option("--model", default="default", show_default=True,
                        help="The policy you serve: 'default' or a checkpoint directory (the "
                             "base of its own version line).")(fn)


def _versions_option(fn):
    return click.option("--versions", "versions_dir",
                        type=click.Path(file_okay=False, path_type=Path),
                        help="Version store (default: $APPRENTICE_HOME/versions).")(fn)


def _online_config(model: str, versions_dir: Path | None, lr: float | None,
                   gate_tasks: int | None, max_update: float | None,
                   max_changed: float | None = None, practice_tasks: int | None = None):
    from learner.online import OnlineConfig
    config = OnlineConfig(model=model, versions=str(versions_dir) if versions_dir else None)
    if lr is not None:
        config.trainer.optim.lr = lr
    if gate_tasks is not None:
        config.gate.n_tasks = gate_tasks
    if max_update is not None:
        config.max_update = max_update
    if max_changed is not None:
        config.max_changed = max_changed
    if practice_tasks is not None:
        config.practice.tasks = practice_tasks
    return config


def _tuning_options(fn):
    for option in reversed([
        click.option("--lr", type=click.FloatRange(0, min_open=True), default=None,
                     help="AdamW learning rate of the update (default 2e-4)."),
        click.option("--max-update", type=click.FloatRange(0), default=None,
                     help="Cap on one cycle's weight change, relative L2 norm (default 5e-3; "
                          "0 = no cap)."),
        click.option("--max-changed", type=click.FloatRange(0, 1), default=None,
                     help="Share of the weights one cycle may change: the changes that do "
                          "the most for the update's objective (default 0.02; 1 = all). Smaller "
                          "deltas to ship to runtimes."),
        click.option("--gate-tasks", type=click.IntRange(0), default=None,
                     help="Held-out simulated tasks the gate runs (default 24; 0 = no gate)."),
        click.option("--practice-tasks", type=click.IntRange(0), default=None,
                     help="Simulated training tasks the serving version practises each "
                          "cycle; its verified passes join the update as positive samples "
                          "(default 0 = none)."),
    ]):
        fn = option(fn)
    return fn


@click.command()
@click.option("--once", is_flag=True, help="Run exactly one cycle (default: cycles until "
                                           "nothing rated waits).")
@click.option("--json", "as_json", is_flag=True,
              help="Print each cycle as one JSON object (samples, liked, disliked, version, "
                   "gate, logprob_shift).")
@_model_option
@_versions_option
@_tuning_options
def online(once: bool, as_json: bool, model: str, versions_dir: Path | None, lr: float | None,
           max_update: float | None, max_changed: float | None,
           gate_tasks: int | None, practice_tasks: int | None) -> None:
    """Learn from your rated sessions now: gather, train, gate, publish."""
    from agent_runtime.store import SessionStore
    from learner.online import LearnerBusy, OnlineLearner
    config = _online_config(model, versions_dir, lr, gate_tasks, max_update, max_changed,
                            practice_tasks)
    with SessionStore() as store:
        learner = OnlineLearner(store, config)
        for _ in range(1 if once else 100):
            try:
                result = learner.run_cycle()
            except (LearnerBusy, FileNotFoundError, ValueError) as exc:
                raise click.ClickException(str(exc))
            if as_json:
                click.echo(json.dumps(result.to_json()))
            else:
                click.echo(_cycle_line(result))
            if result.samples == 0 or result.status != "published":
                break


def _cycle_line(result) -> str:
    if not result.samples:
        return f"nothing to learn: {result.gate.get('reason')}"
    shift = result.logprob_shift
    head = (f"{result.samples} samples ({result.liked} liked, {result.disliked} disliked); "
            f"logprob shift liked {_num(shift['liked'])}, disliked {_num(shift['disliked'])}; ")
    if result.version is not None:
        return head + f"published version {result.version}"
    return head + f"rejected, serving version kept: {result.gate.get('reason')}"


def _num(x) -> str:
    return "-" if x is None else f"{x:+.4f}"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(as_json: bool) -> None:
    """Learner on/off, serving version, samples waiting, last cycle and its result."""
    from agent_runtime.store import SessionStore
    from learner.daemon import status_report
    with SessionStore() as store:
        data, line = status_report(store)
    if as_json:
        click.echo(json.dumps(data, default=str))
        return
    click.echo(f"learner {line}")
    last = data["last_cycle"]
    if data["daemon"]:
        click.echo(f"daemon pid {data['daemon'].get('pid')}, versions at "
                   f"{data['daemon'].get('url') or 'not served'}")
    if last is not None:
        gate = last["gate"] or {}
        click.echo(f"last cycle {last['id']} ({last['started_at'][:19]}): {last['status']}, "
                   f"{last['samples']} samples; gate: {gate.get('reason') or last['reason']}")


@click.command()
@_model_option
@_versions_option
@_tuning_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Where the version server listens.")
@click.option("--port", type=click.IntRange(0), default=8750, show_default=True,
              help="Version server port (0: any free port).")
@click.option("--token", envvar="APPRENTICE_TOKEN", default="",
              help="Bearer token runtimes must send (default: $APPRENTICE_TOKEN, else a new "
                   "one, printed at start).")
@click.option("--no-serve", is_flag=True, help="Learn only; do not serve versions.")
@click.option("--poll-seconds", type=click.FloatRange(0.1), default=60.0, show_default=True,
              help="Look at the schedule this often even when the store does not change.")
def daemon(model: str, versions_dir: Path | None, lr: float | None, max_update: float | None,
           max_changed: float | None, gate_tasks: int | None, practice_tasks: int | None,
           host: str, port: int, token: str, no_serve: bool, poll_seconds: float) -> None:
    """Background learner for this machine: learns from rated sessions, serves versions."""
    import secrets

    from agent_runtime.store import SessionStore
    from learner.daemon import LOG_FILE, Daemon, DaemonConfig, DaemonRunning
    if not token and not no_serve:
        token = secrets.token_hex(16)
        click.echo(f"version server token (pass it to --connect runtimes): {token}", err=True)
    config = DaemonConfig(serve=not no_serve, host=host, port=port, token=token,
                          poll_s=poll_seconds,
                          online=_online_config(model, versions_dir, lr, gate_tasks, max_update,
                                                 max_changed, practice_tasks))
    with SessionStore() as store:
        d = Daemon(store, config)
        d.install_signals()
        click.echo(f"learning from {store.home}; log: {d.dir / LOG_FILE}", err=True)
        try:
            d.run()
        except DaemonRunning as exc:
            raise click.ClickException(str(exc))


# --- versions -----------------------------------------------------------------------------------

@click.group()
def versions() -> None:
    """Published policy versions: list, show one, roll back."""


def _store(versions_dir: Path | None):
    from agent_runtime.store import default_home
    from learner.versions import VersionStore
    root = versions_dir or Path(default_home()) / "versions"
    if not (root / "latest.json").exists():
        raise click.ClickException(f"no versions published in {root} yet")
    return VersionStore(root)


def _sources() -> dict[int, dict]:
    from agent_runtime.store import SessionStore
    with SessionStore() as s:
        return {r["version"]: r for r in s.policy_versions()}


@versions.command("list")
@_versions_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def versions_list(versions_dir: Path | None, as_json: bool) -> None:
    """Every published version, oldest first (the serving one marked *)."""
    import datetime as dt
    vs = _store(versions_dir)
    latest, sources = vs.latest(), _sources()
    infos = [vs.info(v) for v in range(1, latest.version + 1)]
    if as_json:
        click.echo(json.dumps([{**i.to_json(), "source": sources.get(i.version, {}).get("source")}
                               for i in infos]))
        return
    for i in infos:
        ratio = f"{i.nbytes / i.delta_bytes:7.1f}x" if i.delta_bytes else "      -"
        when = dt.datetime.fromtimestamp(i.created).strftime("%Y-%m-%d %H:%M")
        mark = "*" if i.version == latest.version else " "
        click.echo(f"{mark} v{i.version:<4} {when}  {i.sha256[:12]}  delta {ratio}  "
                   f"{sources.get(i.version, {}).get('source') or ''}")


@versions.command("show")
@click.argument("version", type=click.IntRange(1))
@_versions_option
def versions_show(version: int, versions_dir: Path | None) -> None:
    """Metadata of VERSION, and the learning cycle that made it."""
    from learner.versions import VersionNotFound
    vs = _store(versions_dir)
    try:
        info = vs.info(version)
    except VersionNotFound as exc:
        raise click.ClickException(str(exc))
    record = {**info.to_json(), **{k: v for k, v in _sources().get(version, {}).items()
                                   if k in ("source", "meta")}}
    click.echo(json.dumps(record, indent=1))


@versions.command("rollback")
@click.argument("version", type=click.IntRange(1))
@_versions_option
def versions_rollback(version: int, versions_dir: Path | None) -> None:
    """Serve VERSION's weights again, as a new version (runtimes follow it as usual)."""
    from agent_runtime import delta
    from agent_runtime.store import SessionStore
    from learner.versions import VersionNotFound
    vs = _store(versions_dir)
    try:
        state = vs.state(version)
    except VersionNotFound as exc:
        raise click.ClickException(str(exc))
    latest = vs.latest()
    if latest.sha256 == delta.state_sha256(state):
        click.echo(f"version {latest.version} already serves version {version}'s weights")
        return
    new = vs.publish(state)
    with SessionStore() as store:
        store.record_policy_version(new, vs.info(new).sha256, source="rollback",
                                    meta={"to": version, "from": latest.version})
    click.echo(f"published version {new} = the weights of version {version} "
               f"(was serving {latest.version})")
