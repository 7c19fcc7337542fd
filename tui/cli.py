"""The `tui` command, added to `apprentice` through the plugin hook; bare `apprentice` runs
it. Textual is imported only when the command runs, so `apprentice --help` stays fast."""

from __future__ import annotations

from pathlib import Path

import click

from agent_runtime.hooks import hookimpl

APPROVAL_MODES = ("ask", "auto-edit", "full-auto")    # agent_runtime.approvals.MODES, without importing it


@click.command("tui")
@click.option("-w", "--workspace", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=".", show_default=True, help="The repository the agent works in.")
@click.option("--model", default="default", show_default=True,
              help="Policy checkpoint: a model directory, or 'default' for the bundled one.")
@click.option("--policy", "policy_spec", metavar="SPEC",
              help="Policy spec overriding --model, e.g. 'replay:FILE' to replay a JSON list "
                   "of assistant messages (deterministic, no model).")
@click.option("--max-steps", type=click.IntRange(1), default=50, show_default=True,
              help="Model calls allowed per message before the run pauses.")
@click.option("--context-window", type=click.IntRange(256), default=None,
              help="Override the policy's context window (tokens); the context is summarized "
                   "at 80% of it.")
@click.option("--approval", type=click.Choice(APPROVAL_MODES), default="ask",
              show_default=True,
              help="ask: before commands and file changes; auto-edit: file changes run, "
                   "commands ask; full-auto: nothing asks. ctrl+t switches while running.")
@click.option("--connect", metavar="URL", envvar="APPRENTICE_CONNECT",
              help="Follow a learner's version server (http://HOST:PORT): new policy versions "
                   "are applied between model calls.")
@click.option("--token", envvar="APPRENTICE_TOKEN", default="",
              help="Bearer token for --connect (or set $APPRENTICE_TOKEN).")
@click.option("--no-learn", is_flag=True,
              help="Never learn from these sessions (see also [learning] exclude in "
                   "$APPRENTICE_HOME/config.toml).")
def tui_command(workspace: Path, model: str, policy_spec: str | None, max_steps: int,
        context_window: int | None, approval: str, connect: str | None, token: str,
        no_learn: bool) -> None:
    """Open the terminal UI: chat with the agent in a workspace (default: here)."""
    from agent_runtime.policies import check_policy
    try:
        check_policy(policy_spec or model)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load policy {policy_spec or model!r}: {exc}")
    from tui.app import ApprenticeApp
    from tui.runner import Settings
    settings = Settings(workspace=workspace.resolve(), model=model, policy_spec=policy_spec,
                        max_steps=max_steps, context_window=context_window, approval=approval,
                        connect=connect, token=token, learn=not no_learn)
    ApprenticeApp(settings).run()


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(tui_command)
