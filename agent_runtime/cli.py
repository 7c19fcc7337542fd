"""The `apprentice` command line: thin commands over the library.

Every command is a few lines over library calls; heavy imports happen inside commands so
`apprentice --help` stays fast. Bare `apprentice` opens the Textual TUI (issue: terminal UI).
"""

from __future__ import annotations

import click


@click.group(invoke_without_command=True)
@click.version_option(package_name="apprentice")
@click.pass_context
def main(ctx: click.Context) -> None:
    """apprentice: a local coding agent whose own MoE model learns from how you use it."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


if __name__ == "__main__":
    main()
