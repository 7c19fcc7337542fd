"""The learner's commands, added to `apprentice` through the plugin hook (the runtime never
imports this package). Each command is a few lines over `learner` library calls; heavy
imports happen inside the commands."""

from __future__ import annotations

import os
from pathlib import Path

import click

from agent_runtime.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(serve)


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
