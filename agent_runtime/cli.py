"""The `apprentice` command line: thin commands over the library.

Every command is a few lines over library calls; heavy imports happen inside commands so
`apprentice --help` stays fast. Bare `apprentice` opens the Textual TUI (issue: terminal UI).
`run` and `sessions resume` stream the transcript through `Transcript`, the one place here
that formats agent events (`--json` writes them as JSON lines instead).
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import click

from agent_runtime import names

EXIT_CODES = {names.FINISHED: 0, names.FAILED: 1, names.BUDGET_EXHAUSTED: 2, names.CANCELLED: 130}
RESULT_LINES = 12                              # lines of a tool result shown in the transcript


class _Main(click.Group):
    """Bare `apprentice [OPTIONS]` (options, no command) means `apprentice tui [OPTIONS]`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ("--help", "-h", "--version") \
                and "tui" in self.commands:
            args = ["tui", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_Main, invoke_without_command=True)
@click.version_option(package_name="apprentice")
@click.pass_context
def main(ctx: click.Context) -> None:
    """apprentice: a local coding agent whose own MoE model learns from how you use it.

    With no command, opens the terminal UI on the current directory (options such as
    `-w DIR`, `--model PATH` or `--policy replay:FILE` are passed to it)."""
    if ctx.invoked_subcommand is None:
        if "tui" in main.commands:                     # registered by the tui package
            ctx.invoke(main.commands["tui"])
        else:
            click.echo(ctx.get_help())


# --- agent runs ----------------------------------------------------------------------------

def _agent_options(fn):
    """Options shared by `run` and `sessions resume`."""
    for option in reversed([
        click.option("--model", default="default", show_default=True,
                     help="Policy checkpoint: a model directory, or 'default' for the bundled one."),
        click.option("--policy", "policy_spec", metavar="SPEC",
                     help="Policy spec overriding --model, e.g. 'replay:FILE' to replay a JSON "
                          "list of assistant messages (deterministic, no model)."),
        click.option("--max-steps", type=click.IntRange(1), default=50, show_default=True,
                     help="Model calls allowed before the run stops as budget_exhausted."),
        click.option("--context-window", type=click.IntRange(256), default=None,
                     help="Override the policy's context window (tokens); the context is "
                          "summarized at 80% of it."),
        click.option("--quantize", type=click.Choice(["int8"]), default=None,
                     help="Decode with int8 copies of the model's weights (bf16 models; "
                          "prefill and learning keep the weights)."),
        click.option("--json", "as_json", is_flag=True,
                     help="Write events as JSON lines instead of a readable transcript."),
        click.option("--connect", metavar="URL", envvar="APPRENTICE_CONNECT",
                     help="Follow a version server (`apprentice serve`): new policy versions "
                          "are applied between model calls."),
        click.option("--token", envvar="APPRENTICE_TOKEN", default="",
                     help="Bearer token for --connect (or set $APPRENTICE_TOKEN)."),
    ]):
        fn = option(fn)
    return fn


@main.command()
@click.argument("task")
@click.option("-w", "--workspace", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=".", show_default=True, help="The repository the agent works in.")
@click.option("--copy", "copy_workspace", is_flag=True,
              help="Work on a copy of the workspace under $APPRENTICE_HOME/workspaces/ "
                   "and leave the original untouched.")
@click.option("--no-learn", is_flag=True,
              help="Never learn from this session (see also [learning] exclude in "
                   "$APPRENTICE_HOME/config.toml and a workspace's .apprentice-no-learn).")
@_agent_options
def run(task: str, workspace: Path, copy_workspace: bool, no_learn: bool, model: str,
        policy_spec: str | None, max_steps: int, context_window: int | None,
        quantize: str | None, as_json: bool, connect: str | None, token: str) -> None:
    """Run the agent headless on TASK in a workspace, streaming the transcript.

    Exits 0 when the agent called finish, 1 when the run failed, 2 when the step budget
    ran out, 130 when interrupted (Ctrl-C).
    """
    from agent_runtime.learning import session_learns
    from agent_runtime.store import SessionStore
    if not task.strip():
        raise click.UsageError("TASK is empty: say what the agent should do, e.g. "
                               "apprentice run \"make the tests pass\"")
    store = SessionStore()
    learn = session_learns(store.home, workspace, not no_learn)   # before a copy is made
    if copy_workspace:
        target = store.home / "workspaces" / f"{workspace.resolve().name}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(workspace, target, symlinks=True)
        click.echo(f"working on a copy: {target}", err=True)
        workspace = target
    agent = _make_agent(store, workspace, model, policy_spec, max_steps, context_window, as_json,
                        connect, token, learn=learn, quantize=quantize)
    _finish(agent, agent.run(task), as_json)


def _make_agent(store: Any, workspace: Path, model: str, policy_spec: str | None,
                max_steps: int, context_window: int | None, as_json: bool,
                connect: str | None = None, token: str = "", learn: bool = True,
                quantize: str | None = None) -> Any:
    from agent_runtime.agent import Agent, AgentConfig
    from agent_runtime.policies.loading import load_policy
    spec = policy_spec or model
    if quantize and spec.startswith("replay:"):
        raise click.UsageError("--quantize needs a model; a replay script has no weights")
    try:
        policy = load_policy(spec, **({"quantize": quantize} if quantize else {}))
    except (OSError, ValueError) as exc:
        hint = "" if policy_spec else " (or --policy replay:FILE to replay a script)"
        raise click.ClickException(f"cannot load policy {policy_spec or model!r}: {exc}{hint}")
    if context_window:
        policy.context_window = context_window
    if connect:
        from agent_runtime.subscriber import follow
        policy, subscriber = follow(policy, connect, token, store)
        if subscriber is None:
            click.secho("warning: --connect ignored: a replay script has no weights to update",
                        err=True, fg="yellow")
        else:
            click.echo(f"following {connect}: {subscriber.status}", err=True)
    transcript = Transcript(as_json)
    agent = Agent(policy, store=store, workspace=workspace,
                  config=AgentConfig(max_steps=max_steps, learn=learn),
                  callbacks=transcript.callbacks())
    sandbox = agent.sandbox
    if sandbox is None or not sandbox.probe():
        click.secho(getattr(sandbox, "warning", None)
                    or "warning: no sandbox available; commands run unconfined in the workspace",
                    err=True, fg="yellow")
    return agent


def _finish(agent: Any, result: Any, as_json: bool) -> None:
    if as_json:
        _emit({"event": "result", "session_id": result.session_id, "status": result.status,
               "summary": result.summary, "steps": result.steps, "segment": result.segment,
               "error": result.error})
    else:
        mark, color = ("✔", "green") if result.ok else ("✘", "red")
        click.secho(f"\n{mark} {result.status}: {result.summary or ''}", fg=color, bold=True)
        click.echo(f"session {result.session_id}  ({result.steps} steps, "
                   f"segment {result.segment})")
        if result.error:
            click.echo(result.error, err=True)
    agent.store.close()
    sys.exit(EXIT_CODES.get(result.status, 1))


def _emit(event: dict) -> None:
    click.echo(json.dumps(event, ensure_ascii=False, default=str))


class Transcript:
    """Formats agent events for a terminal (or as JSON lines)."""

    def __init__(self, as_json: bool = False):
        self.as_json = as_json
        self.stream = _ToolCallFilter()

    def callbacks(self) -> Any:
        from agent_runtime.agent import Callbacks
        return Callbacks(on_text=self.on_text, on_message=self.on_message,
                         on_tool_start=self.on_tool_start, on_tool_end=self.on_tool_end,
                         on_summarize=self.on_summarize)

    def on_text(self, text: str) -> None:
        if self.as_json:
            _emit({"event": "text", "text": text})
        else:
            click.echo(self.stream.feed(text), nl=False)

    def on_message(self, message_id: int, message: dict) -> None:
        if self.as_json:
            _emit({"event": "message", "id": message_id, "message": message})
        elif message["role"] == "assistant":
            click.echo(self.stream.feed("", end=True), nl=False)
        elif message["role"] == "user" and message.get("kind") == names.KIND_NUDGE:
            click.secho("(no tool call: nudged to continue)", dim=True)

    def on_tool_start(self, call: Any) -> None:
        if self.as_json:
            _emit({"event": "tool_start", "call_id": call.id, "name": call.name,
                   "arguments": call.arguments})
            return
        args = ", ".join(f"{k}={_short(v)}" for k, v in (call.arguments or {}).items())
        click.secho(f"▸ {call.name or 'invalid tool call'}({args})", fg="cyan", bold=True)

    def on_tool_end(self, call: Any, outcome: Any) -> None:
        if self.as_json:
            _emit({"event": "tool_end", "call_id": call.id, "name": call.name, "ok": outcome.ok,
                   "result": outcome.text, "duration_s": round(outcome.duration_s, 4)})
            return
        lines = outcome.text.splitlines() or [""]
        shown = "\n".join("  " + line for line in lines[:RESULT_LINES])
        if len(lines) > RESULT_LINES:
            shown += f"\n  … ({len(lines) - RESULT_LINES} more lines)"
        click.secho(shown, fg=None if outcome.ok else "red", dim=outcome.ok)
        for line in (outcome.data.get("diff") or "").splitlines()[2:RESULT_LINES * 2]:
            color = {"+": "green", "-": "red", "@": "cyan"}.get(line[:1])
            click.secho("  " + line, fg=color)

    def on_summarize(self, segment: int, summary: str) -> None:
        if self.as_json:
            _emit({"event": "summarize", "segment": segment, "summary": summary})
            return
        click.secho(f"── context summarized; segment {segment} begins ──", fg="magenta", bold=True)
        click.secho(summary, fg="magenta")


class _ToolCallFilter:
    """Streamed text minus `<tool_call>` blocks (shown as tool events), as increments of
    `toolcalls.visible_text`, which only ever grows while a message streams."""

    def __init__(self):
        self.raw, self.sent = "", 0

    def feed(self, text: str, end: bool = False) -> str:
        from agent_runtime.toolcalls import visible_text
        self.raw += text
        visible = visible_text(self.raw)
        out, self.sent = visible[self.sent:], len(visible)
        if end:
            out += "\n" if visible else ""
            self.raw, self.sent = "", 0
        return out


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    text = text.replace("\\n", "⏎")
    return text if len(text) <= limit else text[:limit - 1] + "…"


# --- sessions ------------------------------------------------------------------------------

@main.group(invoke_without_command=True)
@click.pass_context
def sessions(ctx: click.Context) -> None:
    """Browse and resume recorded sessions (bare: list the latest)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(sessions_list)


@sessions.command("list")
@click.option("--limit", type=click.IntRange(1), default=20, show_default=True,
              help="How many sessions to show, newest first.")
@click.option("--all", "show_all", is_flag=True,
              help="Also list the sessions `eval` and the learner's rollouts made.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def sessions_list(limit: int = 20, show_all: bool = False, as_json: bool = False) -> None:
    """List your recorded sessions, newest first (--all: also eval and learner ones)."""
    from agent_runtime.store import SessionStore
    with SessionStore() as store:
        rows = store.list_sessions(limit=limit, include_all=show_all)
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False, indent=1, default=str))
        return
    if not rows:
        click.echo("no sessions yet (start one with: apprentice run \"TASK\" -w DIR)")
    for r in rows:
        task = r["task"].splitlines()[0] if r["task"] else ""
        status = "interrupted" if r["interrupted"] else r["status"]
        origin = "" if r["origin"] == names.ORIGIN_USER else f"[{r['origin']}] "
        click.echo(f"{r['id'][:12]}  {r['created_at'][:19]}  {status:<16} "
                   f"{r['message_count']:>4} msgs  {origin}{task[:60]}")


@sessions.command("clean")
@click.option("--older-than", "days", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Keep copies whose latest session started less than this many days ago.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def sessions_clean(days: float, dry_run: bool) -> None:
    """Delete the workspace copies `run --copy` left under $APPRENTICE_HOME/workspaces
    (never one a running session uses). The sessions stay listed; their files go."""
    import datetime as dt

    from agent_runtime.store import SessionStore
    with SessionStore() as store:
        root = store.home / "workspaces"
        copies = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)
        removed, freed = 0, 0
        for copy in copies:
            used = store.sessions_in(copy.resolve())
            if any(s["status"] == names.RUNNING and not s["interrupted"] for s in used):
                click.echo(f"in use   {copy.name}")
                continue
            if used and dt.datetime.fromisoformat(used[0]["created_at"]) > cutoff:
                continue
            size = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file() and not f.is_symlink())
            click.echo(f"{'would remove' if dry_run else 'removed'} {copy.name} "
                       f"({size / 2**20:.1f} MB, {len(used)} session{'s' * (len(used) != 1)})")
            if not dry_run:
                shutil.rmtree(copy)
            removed, freed = removed + 1, freed + size
    click.echo(f"{removed} cop{'ies' if removed != 1 else 'y'} "
               f"{'to remove' if dry_run else 'removed'}, {freed / 2**20:.1f} MB")


@sessions.command("show")
@click.argument("session_id")
@click.option("--full", is_flag=True, help="Show message contents without truncation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (session, segments, "
              "messages, tool calls, feedback).")
def sessions_show(session_id: str, full: bool, as_json: bool) -> None:
    """Show a session's transcript (SESSION_ID may be a unique prefix).

    Message ids (#N) are what `apprentice feedback --message N` takes.
    """
    from agent_runtime.store import SessionStore
    with SessionStore() as store:
        session = _get_session(store, session_id)
        sid = session["id"]
        record = {"session": session, "segments": store.segments(sid),
                  "messages": store.messages(sid), "tool_calls": store.tool_calls(sid),
                  "feedback": store.feedback(sid)}
    if as_json:
        click.echo(json.dumps(record, ensure_ascii=False, indent=1, default=str))
        return
    status = ("interrupted: its process is gone; `apprentice sessions resume` continues it"
              if session["interrupted"] else session["status"])
    click.secho(f"session {sid}  [{status}]", bold=True)
    click.echo(f"task:      {session['task']}\nworkspace: {session['workspace']}\n"
               f"model:     {session['model']} (version {session['policy_version']})")
    if session.get("summary"):
        click.echo(f"summary:   {session['summary']}")
    summaries = {s["idx"]: s["summary"] for s in record["segments"]}
    segment = 0
    for m in record["messages"]:
        if m["segment"] != segment:
            segment = m["segment"]
            click.secho(f"── segment {segment}: summary ──\n{summaries.get(segment) or ''}",
                        fg="magenta")
        _show_message(m, full)
    if not session["learn"] or session["origin"] != names.ORIGIN_USER:
        why = "excluded" if not session["learn"] else f"made by {session['origin']}"
        click.echo(f"learning: never learned from ({why})")
    for f in record["feedback"]:
        click.echo(f"feedback {'+1' if f['rating'] > 0 else '-1'} on "
                   f"{'#' + str(f['message_id']) if f['message_id'] else 'session'}"
                   f" [{f['source']}] {f['reason'] or ''} {f['comment'] or ''}".rstrip())


def _show_message(m: dict, full: bool) -> None:
    kind = (m["meta"] or {}).get("kind")
    label = m["role"] + (f" ({kind})" if kind else "") + (f" {m['name']}" if m["name"] else "")
    content = m["content"] or ""
    if not full and len(content) > 400:
        content = content[:400] + f"… ({len(m['content'])} chars)"
    click.secho(f"#{m['id']} {label}", bold=True, nl=False)
    click.echo(": " + content if content else "")
    for c in m["tool_calls"] or []:
        fn = c.get("function", {})
        click.secho(f"    ▸ {fn.get('name')} {json.dumps(fn.get('arguments'))[:200]}", fg="cyan")


@sessions.command("resume")
@click.argument("session_id")
@click.option("--message", "message", metavar="TEXT",
              help="A user message to add before continuing.")
@_agent_options
def sessions_resume(session_id: str, message: str | None, model: str, policy_spec: str | None,
                    max_steps: int, context_window: int | None, quantize: str | None,
                    as_json: bool, connect: str | None, token: str) -> None:
    """Continue a session (after a crash, a cancel, a budget stop or a finish).

    The context is rebuilt from the store: system prompt, task, the latest segment's summary
    and the messages after it. Exit codes as for `apprentice run`.
    """
    from agent_runtime.store import SessionStore
    store = SessionStore()
    session = _get_session(store, session_id)
    workspace = Path(session["workspace"])
    if not workspace.is_dir():
        raise click.ClickException(f"the session's workspace {workspace} no longer exists")
    agent = _make_agent(store, workspace, model, policy_spec, max_steps, context_window, as_json,
                        connect, token, quantize=quantize)
    _finish(agent, agent.resume(session["id"], message=message), as_json)


def _get_session(store: Any, session_id: str) -> dict:
    try:
        return store.get_session(session_id)
    except KeyError as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc))


# --- feedback ------------------------------------------------------------------------------

class _Reasons(click.Choice):
    """The store's feedback reasons, looked up only when needed (keeps --help fast)."""

    def __init__(self):
        super().__init__([])

    @property
    def choices(self):
        from agent_runtime.store import FEEDBACK_REASONS
        return FEEDBACK_REASONS

    @choices.setter
    def choices(self, value):
        pass


@main.command()
@click.argument("session_id")
@click.argument("rating", type=click.Choice(["up", "down"]))
@click.option("--message", "message_id", type=int, metavar="N",
              help="Rate message #N (ids from `apprentice sessions show`) instead of the session.")
@click.option("--reason", type=_Reasons(), help="Why (mostly for a down rating).")
@click.option("--comment", metavar="TEXT", help="Free-form comment.")
def feedback(session_id: str, rating: str, message_id: int | None, reason: str | None,
             comment: str | None) -> None:
    """Rate a session, or one of its messages, up or down (SESSION_ID may be a prefix)."""
    from agent_runtime.store import SessionStore
    with SessionStore() as store:
        sid = _get_session(store, session_id)["id"]
        try:
            row = store.add_feedback(1 if rating == "up" else -1, session_id=sid,
                                     message_id=message_id, reason=reason, comment=comment)
        except ValueError as exc:
            raise click.ClickException(str(exc))
        replaced = [f for f in store.feedback(sid) if f["replaced_by"] == row]
    was = "".join(f" (replaces #{f['id']}: {'up' if f['rating'] > 0 else 'down'})"
                  for f in replaced)
    click.echo(f"recorded feedback {row}: {rating} on "
               f"{'message #' + str(message_id) if message_id else 'session'} {sid[:12]}{was}")


def _load_plugins() -> None:
    """Let `learner`, `tui` and third-party plugins add their commands (entry points)."""
    from agent_runtime.hooks import plugin_manager
    plugin_manager().hook.register_commands(cli=main)


_load_plugins()

if __name__ == "__main__":
    main()
