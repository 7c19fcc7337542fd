"""The `acp` command, added to `apprentice` through the plugin hook. The ACP SDK is imported
only when the command runs, so `apprentice --help` stays fast."""

from __future__ import annotations

import click

from agent_runtime.hooks import hookimpl

APPROVAL_MODES = ("ask", "auto-edit", "full-auto")    # agent_runtime.approvals.MODES


@click.command("acp")
@click.option("--model", default="default", show_default=True,
              help="Policy checkpoint: a model directory, or 'default' for the bundled one.")
@click.option("--policy", "policy_spec", metavar="SPEC",
              help="Policy spec overriding --model, e.g. 'replay:FILE'.")
@click.option("--max-steps", type=click.IntRange(1), default=50, show_default=True,
              help="Model calls allowed per prompt before it stops (max_turn_requests).")
@click.option("--context-window", type=click.IntRange(256), default=None,
              help="Override the policy's context window (tokens).")
@click.option("--approval", type=click.Choice(APPROVAL_MODES), default="ask", show_default=True,
              help="Initial session mode: ask (before commands and file changes), auto-edit "
                   "(file changes run, commands ask) or full-auto; the editor can switch it.")
@click.option("--max-message-bytes", type=click.IntRange(1024), default=16 * 2**20,
              show_default=True, help="Larger incoming messages are answered with an error "
                                      "and discarded.")
@click.option("--connect", metavar="URL", envvar="APPRENTICE_CONNECT",
              help="Follow a version server (`apprentice serve`): new policy versions are "
                   "applied between model calls.")
@click.option("--token", envvar="APPRENTICE_TOKEN", default="",
              help="Bearer token for --connect (or set $APPRENTICE_TOKEN).")
def acp_command(model: str, policy_spec: str | None, max_steps: int,
                context_window: int | None, approval: str, max_message_bytes: int,
                connect: str | None, token: str) -> None:
    """Serve the Agent Client Protocol on stdio, for editors (Zed, Neovim, JetBrains...)."""
    import asyncio
    import logging
    import sys

    from agent_runtime.policies import check_policy
    from plugins.acp.server import AcpConfig
    try:
        check_policy(policy_spec or model)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load policy {policy_spec or model!r}: {exc}")
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="apprentice acp: %(levelname)s %(message)s")
    config = AcpConfig(policy_spec or model, max_steps, approval, context_window,
                       max_message_bytes, connect, token)
    asyncio.run(serve(config))


async def serve(config) -> None:
    """Run the ACP agent on this process's stdin/stdout until the editor hangs up."""
    from acp.agent.connection import AgentSideConnection

    from agent_runtime.store import SessionStore
    from plugins.acp.server import ApprenticeAgent
    from plugins.acp.wire import stdio_transport
    with SessionStore() as store:
        agent = ApprenticeAgent(config, store)
        transport = await stdio_transport(config.max_message_bytes)
        connection = AgentSideConnection(agent, transport, listening=False)
        try:
            await connection.listen()
        finally:
            for session in agent.sessions.values():
                session.cancel()


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(acp_command)


@hookimpl
def register_feedback_sources(register) -> None:
    from agent_runtime.approvals import REJECTED_SOURCE
    register(REJECTED_SOURCE, "the user rejected a tool call the agent proposed (a permission "
                              "request in the editor): a -1 on the turn that proposed it")
