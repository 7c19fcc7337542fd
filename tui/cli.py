"""The `tui` command, added to `apprentice` through the plugin hook; bare `apprentice` runs
it. Textual is imported only when the command runs."""

from __future__ import annotations

import click

from agent_runtime.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    pass   # the terminal UI registers `tui` here once it exists
