"""The agent loop: ask the policy, run the tool calls it wrote, append the results, repeat.

The loop is linear and append-only. Each step renders the context with the policy's chat
template (inside `Policy.complete`), parses zero or more `<tool_call>` blocks, runs them
(read-only calls of one turn concurrently, mutating ones alone and in order) and appends
their results as `tool` messages. Leaving the loop is an exception that carries its reason
(`Finished`, `BudgetExhausted`, `Cancelled`); the session's status is saved in `finally`.

Every step is committed to the store before the next model call: the assistant message with
its sample in one transaction, each tool call's row before it runs, and its result together
with its `tool` message after. A process killed at any moment leaves a consistent database,
and `Agent.resume` rebuilds the context from it (latest segment: system prompt + task +
summary + the messages after it). This module does not render prompts, parse tool calls or
decide when to summarize; `policy`, `toolcalls` and `context` do.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent_runtime.context import (DEFAULT_SUMMARY_INSTRUCTION, SUMMARY_REQUEST, Context,
                                   ContextConfig)
from agent_runtime import names
from agent_runtime.names import ORIGIN_USER
from agent_runtime.callgrammar import CallGrammar, WorkspaceView
from agent_runtime.mentions import with_mentions, workspace_files
from agent_runtime.policies.base import Completion, Policy, constrains, remembers
from agent_runtime.toolcalls import ToolCall, call_key, check_calls, parse_tool_calls
from agent_runtime.tools.base import Tool, ToolContext, ToolError, tool_schema

DEFAULT_SYSTEM_PROMPT = """\
You are apprentice, a careful coding agent. You work in a repository (the workspace) through \
the tools below; every path is relative to the workspace root. Look before you change \
anything: read the relevant files, make small, precise edits, and run the tests or the code \
to check your work. You may call several tools in one message; calls that only read run in \
parallel. When the task is done (or cannot be done), call `finish` with a short summary of \
what you changed and how you checked it."""

NUDGE = ("Your last message contained no tool call, and nobody is reading it until you call "
         "`finish`. Continue the task with a tool call, or call `finish` with a summary if it "
         "is done. A call looks like:\n<tool_call>\n"
         '{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>')
INVALID_CALL = "invalid_tool_call"             # tool name recorded for calls that did not parse
EDITS_FILE = "edits.json"                      # in the session folder: files the agent changed


@dataclass
class AgentConfig:
    max_steps: int = 50                        # model calls allowed per run()/resume() (summaries excluded)
    stuck_after: int = 4                       # end the run (status "failed") when this many
                                               # turns in a row made the same tool calls and
                                               # got the same results, as OpenHands' stuck
                                               # detector does; 0: never
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # the system message; the template appends the tools
    summarize_at: float = 0.8                  # summarize when the prompt reaches this fraction of the window
    summary_instruction: str = DEFAULT_SUMMARY_INSTRUCTION  # what the policy is asked when summarizing
    summary_max_tokens: int = 1024             # generation budget of one summary
    max_new_tokens: int | None = None          # generation budget of one turn; None: the policy's own
    nudge: str = NUDGE                         # user message sent after a turn without tool calls
    max_parallel: int = 8                      # read-only calls of one turn running at once
    origin: str = ORIGIN_USER                  # who makes the session (names.ORIGINS); only
                                               # "user" sessions are learned from
    learn: bool = True                         # False: the session is never trained on
    constrain_calls: bool = True               # policies that can (the engine) write only
                                               # well-formed tool calls: valid JSON, known
                                               # tools and arguments of their types
                                               # (agent_runtime.callgrammar)
    check_references: bool = False             # with constrain_calls, also hold what a call
                                               # names to the workspace (the paths it reads
                                               # exist, edit_file's `old` is in the file and
                                               # its `new` differs). Off: the calls' form only,
                                               # and a call naming what is not there fails with
                                               # the tool's error; on the default model the
                                               # same pass@1, and no edit forced into a file the
                                               # model did not mean (README, "Only the form,
                                               # by default")
    mentions: bool | None = None               # append where the task's names are defined
                                               # (agent_runtime.mentions); None: when the
                                               # policy was trained with it (`policy.mentions`)

    def context_config(self) -> ContextConfig:
        return ContextConfig(summarize_at=self.summarize_at,
                             summary_instruction=self.summary_instruction,
                             summary_max_tokens=self.summary_max_tokens)


@dataclass
class ToolOutcome:
    text: str                                  # what the model sees
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0


@dataclass
class Callbacks:
    """Hooks for UIs. All run on the loop's thread, in order, after the store write."""
    on_text: Callable[[str], None] | None = None                  # assistant text as it streams
    on_message: Callable[[int, dict], None] | None = None         # (message id, message) appended
    on_tool_start: Callable[[ToolCall], None] | None = None       # a call is about to run
    on_tool_end: Callable[[ToolCall, ToolOutcome], None] | None = None
    on_summarize: Callable[[int, str], None] | None = None        # (new segment, summary)
    on_sample: Callable[[int, Completion], None] | None = None    # (sample id, completion)


class AgentExit(Exception):
    """Leaving the loop; `status` is what the store records."""
    status = names.FAILED

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


class Finished(AgentExit):
    status = names.FINISHED


class BudgetExhausted(AgentExit):
    status = names.BUDGET_EXHAUSTED


class Cancelled(AgentExit):
    status = names.CANCELLED


class Stuck(AgentExit):
    """The same calls with the same results, `AgentConfig.stuck_after` turns in a row."""


@dataclass
class RunResult:
    session_id: str
    status: str                                # finished | failed | cancelled | budget_exhausted
    summary: str | None                        # finish()'s summary, or why the run stopped
    steps: int                                 # model calls in this run (summaries excluded)
    segment: int                               # the segment the run ended in
    messages: list[dict]                       # the context at exit
    error: str | None = None                   # traceback when the run failed on an exception

    @property
    def ok(self) -> bool:
        return self.status == names.FINISHED


class Agent:
    """One agent over a policy, a tool set, a store and a workspace; runs one session at a time."""

    def __init__(self, policy: Policy, tools: list[Tool] | None = None, store: Any = None,
                 workspace: str | Path = ".", *, config: AgentConfig | None = None,
                 callbacks: Callbacks | None = None, sandbox: Any = None,
                 cancel_event: threading.Event | None = None,
                 should_stop: Callable[[], bool] | None = None):
        if tools is None:                      # the built-ins and every plugin's tools
            from agent_runtime.hooks import plugin_tools
            tools = plugin_tools(workspace)
        if store is None:
            from agent_runtime.store import SessionStore
            store = SessionStore()
        self.policy, self.store = policy, store
        self.workspace = Path(workspace).resolve()
        self.config = config or AgentConfig()
        self.callbacks = callbacks or Callbacks()
        self.tools = {t.name: t for t in tools}
        self.schemas = [tool_schema(t) for t in tools]
        self.grammar = (CallGrammar(tools) if self.config.constrain_calls and constrains(policy)
                        else None)
        self.sandbox = sandbox if sandbox is not None else _default_sandbox(self.workspace)
        self.cancel_event = cancel_event or threading.Event()
        self._should_stop = should_stop          # the caller's own stop (a learner's run)
        self.session_id: str | None = None
        self.context: Context | None = None
        self.steps = 0
        self._pool: ThreadPoolExecutor | None = None
        self._edits: dict[str, str | None] = {}   # path -> sha256 before the first change
        self._turns: deque[tuple | None] = deque(maxlen=self.config.stuck_after)
                                                  # the latest turns' calls and results

    def cancel(self) -> None:
        """Stop at the next check: between steps, between tool calls, or inside generation."""
        self.cancel_event.set()

    def stopping(self) -> bool:
        """Whether the run must stop: cancelled (`cancel`, which a new run clears), or the
        `should_stop` the agent was made with (never cleared here) turned true."""
        return self.cancel_event.is_set() or (self._should_stop is not None
                                              and self._should_stop())

    # -- entry points --------------------------------------------------------------------

    def run(self, task: str, session_id: str | None = None) -> RunResult:
        """Start a new session on `task` and run it to the end. `session_id` names the new
        session (a front end that handed out the id before the first task, e.g. ACP)."""
        self.session_id = self.store.create_session(
            task, str(self.workspace), self.policy.name, self.policy.version,
            meta={"context_window": self.policy.context_window,
                  "max_steps": self.config.max_steps, "tools": sorted(self.tools)},
            session_id=session_id, origin=self.config.origin, learn=self.config.learn)
        mention = self.config.mentions
        if mention is None:                    # as the policy was trained
            mention = getattr(self.policy, "mentions", False)
        shown = with_mentions(task, workspace_files(self.workspace)) if mention else task
        self.context = Context(self.config.system_prompt, shown,
                               config=self.config.context_config())
        with self.store.transaction():
            for message in self.context.head:
                self._record(message)
        return self._loop()

    def resume(self, session_id: str, message: str | None = None) -> RunResult:
        """Continue a session from the store (after a crash, a cancel or a finish)."""
        self.session_id = self.store.get_session(session_id)["id"]
        self.context = self._rebuild()
        self._close_interrupted_turn()
        if message:
            self._append({"role": "user", "content": message, "kind": names.KIND_USER})
        return self._loop()

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> RunResult:
        self.cancel_event.clear()
        self.steps, status, summary, error = 0, names.FAILED, None, None
        self._turns.clear()
        session_dir = self.store.session_dir(self.session_id)
        self.tool_context = ToolContext(workspace=self.workspace, sandbox=self.sandbox,
                                        session_dir=session_dir)
        if self.sandbox is not None and getattr(self.sandbox, "session_dir", "") is None:
            self.sandbox.session_dir = session_dir     # where it spills long command output
        self.store.set_status(self.session_id, names.RUNNING)
        try:
            while True:
                self.step()
        except AgentExit as exc:
            status, summary = exc.status, exc.message
        except KeyboardInterrupt:
            status, summary = names.CANCELLED, "interrupted by the user"
        except Exception as exc:                 # a failing policy, store or bug: record it
            summary, error = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        finally:
            self.store.set_status(self.session_id, status, summary)
            self._save_edits(session_dir)
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
        return RunResult(self.session_id, status, summary, self.steps, self.context.segment,
                         self.context.messages, error)

    def step(self) -> None:
        """One model call and the tool calls it made; raises `AgentExit` to leave the loop."""
        if self.stopping():
            raise Cancelled("cancelled by the user")
        if self.steps >= self.config.max_steps:
            raise BudgetExhausted(f"the step budget of {self.config.max_steps} is spent")
        used = self.policy.count_tokens(self.context.messages, self.schemas)
        if self.context.should_summarize(used, self.policy.context_window):
            self.summarize()
            used = self.policy.count_tokens(self.context.messages, self.schemas)
        self.context.check_fits(used, self.policy)
        self.steps += 1
        held = {}
        if self.grammar is not None:          # the workspace as it is now
            held = {"grammar": self.grammar.at(WorkspaceView(self.workspace)
                                               if self.config.check_references else None)}
        completion = self.policy.complete(
            self.context.messages, self.schemas, max_new_tokens=self.config.max_new_tokens,
            on_text=self.callbacks.on_text, should_stop=self.stopping, **held)
        turn = parse_tool_calls(completion.text)
        calls = check_calls(turn.calls, self.tools)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if any(c.name is not None for c in calls):
            message["tool_calls"] = [c.as_message_call() for c in calls if c.name is not None]
        if remembers(self.policy):             # later prompts feed this call's ids as written
            self.policy.remember(message, completion)
        with self.store.transaction():
            message_id = self._record(message)
            sample_id = self._add_sample(completion, message_id, self.context.segment)
        self.context.append(message)
        self._notify(message_id, message, sample_id, completion)
        if completion.finish_reason == names.FINISH_CANCELLED:
            raise Cancelled("cancelled by the user")
        if not calls:
            self._turns.append(None)
            cut = {names.FINISH_LENGTH: "Your last message was cut off at the length limit. ",
                   names.FINISH_LOOP: "Your last message was cut off: it kept repeating itself. "}
            self._append({"role": "user", "kind": names.KIND_NUDGE, "content":
                          cut.get(completion.finish_reason, "") + self.config.nudge})
            return
        finish_summary = self._run_calls(calls, message_id)
        if finish_summary is not None:
            raise Finished(finish_summary)
        self._check_stuck()

    def _check_stuck(self) -> None:
        """Raise `Stuck` when the last `stuck_after` turns made the same calls and got the
        same results, durations aside (`call_key`): nothing the model saw changed but a
        test run's timing, so a greedy policy would go on the same
        way until the step budget is spent (with the default model, a quarter of all its
        calls on held-out tasks: README, "Stuck runs end")."""
        k, turns = self.config.stuck_after, self._turns
        if k and len(turns) == k and turns[0] is not None and turns.count(turns[0]) == k:
            raise Stuck(f"stuck: the same tool calls got the same results {k} turns in a row")

    def summarize(self) -> None:
        """Replace the context by the policy's own summary of it; starts the next segment."""
        old = self.context.segment
        request, completion, summary = self.context.summarize(
            self.policy, should_stop=self.stopping)
        if completion.finish_reason == names.FINISH_CANCELLED:
            raise Cancelled("cancelled by the user")
        carried = self.context.restart(summary)
        with self.store.transaction():
            self._record(request[-1], segment=old)
            summary_id = self._record({"role": "assistant", "content": summary,
                                       "kind": names.KIND_SUMMARY}, segment=old)
            self._add_sample(completion, summary_id, old)
            self.store.add_segment(self.session_id, self.context.segment, summary)
            for message in carried:
                self._record(message)
        if self.callbacks.on_summarize:
            self.callbacks.on_summarize(self.context.segment, summary)

    # -- tool calls ----------------------------------------------------------------------

    def _run_calls(self, calls: list[ToolCall], message_id: int) -> str | None:
        """Run a turn's calls (reads concurrently, writes alone and in order); returns
        finish()'s summary when finish succeeded."""
        finish_summary = None
        turn: list[tuple] = []
        for n, group in enumerate(self._groups(calls)):
            if self.stopping():
                rest = [c for g in self._groups(calls)[n:] for c in g]
                self._record_calls(rest, message_id, [ToolOutcome(
                    "Not run: the user cancelled the session before this call.", False)] * len(rest))
                raise Cancelled("cancelled by the user")
            with self.store.transaction():
                rows = [self.store.add_tool_call(
                    self.session_id, message_id, c.id, c.name or INVALID_CALL,
                    c.arguments if c.arguments is not None else c.raw) for c in group]
            for call in group:
                if self.callbacks.on_tool_start:
                    self.callbacks.on_tool_start(call)
            outcomes = self._execute(group)
            for call, row, outcome in zip(group, rows, outcomes):
                self._finish_call(call, row, outcome)
                turn.append(call_key(call.name, call.arguments if call.arguments is not None
                                     else call.raw, outcome.text))
                if call.name == "finish" and outcome.ok:
                    finish_summary = str((call.arguments or {}).get("summary") or outcome.text)
        self._turns.append(tuple(turn))
        return finish_summary

    def _groups(self, calls: list[ToolCall]) -> list[list[ToolCall]]:
        groups: list[list[ToolCall]] = []
        for call in calls:
            tool = self.tools.get(call.name) if call.error is None else None
            if tool is not None and tool.mutates:
                groups.append([call])
            elif groups and not _mutating(groups[-1], self.tools):
                groups[-1].append(call)
            else:
                groups.append([call])
        return groups

    def _execute(self, group: list[ToolCall]) -> list[ToolOutcome]:
        if len(group) == 1:
            return [self._call(group[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.max_parallel, thread_name_prefix="tool")
        return list(self._pool.map(self._call, group))

    def _call(self, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(call.error, False)
        start = time.perf_counter()
        if self.tools[call.name].mutates:
            self._note_edit(call)
        try:
            result = self.tools[call.name](call.arguments, self.tool_context)
            outcome = ToolOutcome(result.text, True, dict(result.data or {}))
        except ToolError as exc:
            outcome = ToolOutcome(str(exc), False)
        except Exception as exc:                 # a bug in the tool: tell the model, keep going
            outcome = ToolOutcome(
                f"Error: the {call.name} tool failed unexpectedly ({type(exc).__name__}: "
                f"{exc}). This is a fault of the tool, not of your call.",
                False, {"traceback": traceback.format_exc()})
        outcome.duration_s = time.perf_counter() - start
        return outcome

    def _finish_call(self, call: ToolCall, row: int, outcome: ToolOutcome) -> None:
        message = {"role": "tool", "content": outcome.text,
                   "name": call.name or INVALID_CALL, "tool_call_id": call.id}
        with self.store.transaction():
            self.store.finish_tool_call(row, outcome.text, outcome.ok, outcome.duration_s,
                                        outcome.data or None)
            message_id = self._record(message)
        self.context.append(message)
        self._notify(message_id, message)
        if self.callbacks.on_tool_end:
            self.callbacks.on_tool_end(call, outcome)

    def _record_calls(self, calls: list[ToolCall], message_id: int,
                      outcomes: list[ToolOutcome]) -> None:
        """Record calls that will not run, each with its outcome and `tool` message."""
        for call, outcome in zip(calls, outcomes):
            with self.store.transaction():
                row = self.store.add_tool_call(
                    self.session_id, message_id, call.id, call.name or INVALID_CALL,
                    call.arguments if call.arguments is not None else call.raw)
                self._finish_call(call, row, outcome)

    # -- what the session changed (the learner judges later whether the user kept it) ----

    def _note_edit(self, call: ToolCall) -> None:
        path = (call.arguments or {}).get("path")
        if isinstance(path, str) and path not in self._edits:
            target = _inside(self.workspace, path)
            if target is not None:
                self._edits[path] = _file_sha256(target)

    def _save_edits(self, session_dir: Path) -> None:
        """`edits.json`: per changed file, its sha256 before the session's first change and
        after the session (None: absent). A resumed session keeps the first "before"."""
        if not self._edits:
            return
        path = session_dir / EDITS_FILE
        try:
            old = json.loads(path.read_text())["files"] if path.exists() else {}
        except (OSError, ValueError, KeyError):
            old = {}
        files = {}
        for rel, before in {**self._edits, **{k: v["before"] for k, v in old.items()}}.items():
            target = _inside(self.workspace, rel)
            files[rel] = {"before": before,
                          "after": _file_sha256(target) if target is not None else None}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"workspace": str(self.workspace), "files": files}, indent=1))
        tmp.replace(path)

    # -- store ---------------------------------------------------------------------------

    def _record(self, message: dict, segment: int | None = None) -> int:
        kind = message.get("kind")
        return self.store.add_message(
            self.session_id, self.context.segment if segment is None else segment,
            message["role"], message.get("content") or "", tool_calls=message.get("tool_calls"),
            tool_call_id=message.get("tool_call_id"), name=message.get("name"),
            meta={"kind": kind} if kind else None)

    def _append(self, message: dict) -> int:
        """Record a message, then add it to the context (in that order)."""
        message_id = self._record(message)
        self.context.append(message)
        self._notify(message_id, message)
        return message_id

    def _notify(self, message_id: int, message: dict, sample_id: int | None = None,
                completion: Completion | None = None) -> None:
        if sample_id is not None and self.callbacks.on_sample:
            self.callbacks.on_sample(sample_id, completion)
        if self.callbacks.on_message:
            self.callbacks.on_message(message_id, message)

    def _add_sample(self, completion: Completion, message_id: int, segment: int) -> int:
        return self.store.add_sample(
            self.session_id, segment, message_id, completion.prompt_ids,
            completion.completion_ids, completion.logprobs, completion.routes,
            completion.version, completion.finish_reason, completion.temperature,
            forced=completion.meta.get("forced"))

    # -- resume --------------------------------------------------------------------------

    def _rebuild(self) -> Context:
        """The context of the session's latest segment, from the store."""
        session = self.store.get_session(self.session_id)
        rows = self.store.messages(self.session_id)
        system = next((r["content"] for r in rows if r["role"] == "system"),
                      self.config.system_prompt)
        latest = self.store.segments(self.session_id)[-1]
        task = next((r["content"] for r in rows if (r["meta"] or {}).get("kind") == names.KIND_TASK),
                    session["task"])               # as the policy saw it (with its mentions)
        context = Context(system, task, summary=latest["summary"],
                          segment=latest["idx"], config=self.config.context_config())
        skip = {"task", "summary", SUMMARY_REQUEST}
        self._turn_ids: list[int] = []         # store ids of context.turns, for the repair
        for r in rows:
            kind = (r["meta"] or {}).get("kind")
            if r["segment"] == latest["idx"] and r["role"] != "system" and kind not in skip:
                message = {"role": r["role"], "content": r["content"]}
                for key in ("tool_calls", "tool_call_id", "name"):
                    if r[key] is not None:
                        message[key] = r[key]
                if kind:
                    message["kind"] = kind
                context.turns.append(message)
                self._turn_ids.append(r["id"])
        context.fresh = latest["idx"] > 0 and not context.turns
        return context

    def _close_interrupted_turn(self) -> None:
        """Answer the calls of a turn the crash cut short, and nudge after a bare turn."""
        turns = self.context.turns
        last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=None)
        if last is None:
            return
        answered = {m.get("tool_call_id") for m in turns[last + 1:] if m["role"] == "tool"}
        rows = {r["call_id"]: r for r in self.store.tool_calls(self.session_id)}
        for entry in turns[last].get("tool_calls") or []:
            if entry.get("id") in answered:
                continue
            function = entry.get("function", {})
            call = ToolCall(function.get("name"), function.get("arguments"), "", id=entry["id"])
            text = ("Error: the session stopped before this call finished; its effect, if any, "
                    "is unknown. Check the state before repeating it.")
            row = rows.get(call.id)
            with self.store.transaction():
                if row is None:
                    row_id = self.store.add_tool_call(self.session_id, self._turn_ids[last],
                                                      call.id, call.name, call.arguments or {})
                else:
                    row_id = row["id"]
                self._finish_call(call, row_id, ToolOutcome(text, False))
        if not turns[last].get("tool_calls") and last == len(turns) - 1:
            self._append({"role": "user", "kind": names.KIND_NUDGE, "content": self.config.nudge})


def _mutating(group: list[ToolCall], tools: dict[str, Tool]) -> bool:
    return any(c.error is None and c.name in tools and tools[c.name].mutates for c in group)


def _inside(workspace: Path, rel: str) -> Path | None:
    """`workspace/rel` when it stays inside the workspace, else None."""
    target = (workspace / rel).resolve()
    return target if target == workspace or workspace in target.parents else None


def _file_sha256(path: Path) -> str | None:
    """sha256 of a file's bytes; None when it does not exist or cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _default_sandbox(workspace: Path) -> Any:
    try:
        from agent_runtime.sandbox import Sandbox
    except ImportError:
        return None
    return Sandbox(workspace)
