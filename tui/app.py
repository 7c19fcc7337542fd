"""`ApprenticeApp`: the Textual app people meet the agent through.

A chat over one workspace. Each prompt starts a session (`Agent.run`) or continues the
current one (`Agent.resume` with the prompt as a new user message). The agent runs in a
thread worker; its callbacks come back to the UI thread through `call_from_thread`, in
order. Tool calls that need consent block the worker until the approval prompt answers
(`approvals.py`). Ratings go straight to the store's feedback table.

Not here: widgets (`widgets.py`), dialogs (`screens.py`), policy loading and the learner
follower (`runner.py`), approval rules (`approvals.py`).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Input, Static

from agent_runtime import names
from tui import runner
from agent_runtime.approvals import MODES, ApprovalGate, ApprovalStore, Request, gated
from tui.screens import ApprovalScreen, FeedbackScreen, HelpScreen, SessionsScreen
from tui.widgets import AssistantMessage, ChatLog

END_NOTES = {
    names.FINISHED: ("✔ finished: {summary}", "ok"),
    names.CANCELLED: ("⊘ cancelled; the session is kept. Write to continue it.", "warn"),
    names.BUDGET_EXHAUSTED: ("⏸ {summary}. Write to continue.", "warn"),
    names.FAILED: ("✘ the run failed: {summary}", "error"),
}


INTRO = ("New session. Write a task below. esc cancels a run · ctrl+r resumes an earlier "
         "session · ↑ from the empty input selects messages, then + / - rates them · "
         "ctrl+u / ctrl+d rate the whole session · ctrl+t switches approvals · f1 help · "
         "ctrl+q quits")


class PromptInput(Input):
    """The chat input; ↑ on an empty line moves to the last assistant message (to rate it)."""

    BINDINGS = [
        Binding("up", "to_messages", "messages", show=False),
        Binding("ctrl+d", "app.rate_session(-1)", "-1 session"),  # over Input's line editing
        Binding("ctrl+u", "app.rate_session(1)", "+1 session"),
    ]

    def action_to_messages(self) -> None:
        messages = list(self.screen.query(AssistantMessage))
        if not self.value and messages:
            messages[-1].focus()
            messages[-1].scroll_visible()


class ApprenticeApp(App):
    """The coding agent in a terminal: chat, tool panels, approvals, ratings, sessions."""

    CSS_PATH = "app.tcss"
    TITLE = "apprentice"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "cancel", "cancel"),
        Binding("ctrl+r", "sessions", "sessions"),
        Binding("ctrl+n", "new_session", "new"),
        Binding("ctrl+t", "cycle_approval", "approvals"),
        Binding("ctrl+u", "rate_session(1)", "+1 session"),
        Binding("ctrl+d", "rate_session(-1)", "-1 session"),
        Binding("f1", "help", "help"),
        Binding("question_mark", "help", "help", show=False),   # the input types its own ?
        Binding("ctrl+q", "quit", "quit"),
    ]

    def __init__(self, settings: runner.Settings | None = None, *, policy: Any = None,
                 store: Any = None):
        super().__init__()
        self.settings = settings or runner.Settings()
        self.workspace = Path(self.settings.workspace).resolve()
        self.policy, self.store = policy, store
        self.policy_error: str | None = None
        self.subscriber: Any = None
        self.gate: ApprovalGate | None = None
        self.agent: Any = None                 # the Agent of the run in progress (or the last)
        self.session_id: str | None = None     # the session prompts continue; None: a new one
        self.running = False
        self.pending: str | None = None        # a prompt sent while the policy was loading
        self.context_used: int | None = None
        self.learner_line: str | None = None   # the local learner's state, read every second
        self.closing_down = False
        self._sandbox_checked = False
        # the main screen's widgets, kept so that they are reachable under a dialog
        self.chat = ChatLog(id="chat")
        self.prompt = PromptInput(placeholder="Ask apprentice to change something… "
                                  "(enter to send)", id="prompt")
        self.activity = Static("", id="activity")
        self.status_model = Static("", id="status-model")
        self.status_right = Static("", id="status-right")

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="topbar"):
            yield Static(f"apprentice · {runner.short_path(self.workspace)}", id="title")
            yield self.activity
        yield self.chat
        yield self.prompt
        with Horizontal(id="statusbar"):
            yield self.status_model
            yield self.status_right
        yield Footer()

    def on_mount(self) -> None:
        self.prompt.focus()
        self.chat.note(INTRO, "dim")
        self.set_interval(0.5, self.refresh_status)
        self.set_interval(1.0, self.poll_learner)
        self.load_runtime()

    @work(thread=True, exit_on_error=False, group="learner", exclusive=True)
    def poll_learner(self) -> None:
        """Read the local learner's state off the UI thread (the footer shows it live)."""
        if self.store is None:
            return
        try:
            line = runner.local_learner(self.store)
        except Exception as exc:               # a store being migrated, a bad config...
            line = f"unknown ({type(exc).__name__})"
        self._post(self._learner_read, line)

    def _learner_read(self, line: str) -> None:
        self.learner_line = line
        self.refresh_status()

    @work(thread=True, exit_on_error=False, group="load")
    def load_runtime(self) -> None:
        """Open the store and load the policy off the UI thread (a model takes a while)."""
        try:
            from agent_runtime.store import SessionStore
            store = self.store or SessionStore()
            policy, error = (self.policy, None) if self.policy else runner.load(self.settings)
        except Exception as exc:               # an unreadable store: show it, keep the UI alive
            self._post(self._load_failed, f"{type(exc).__name__}: {exc}")
            return
        self._post(self.runtime_ready, policy, error, store)
        import agent_runtime.agent, agent_runtime.tools.registry  # noqa: F401,E401  warm up

    def _load_failed(self, error: str) -> None:
        self.policy_error = f"cannot open the session store: {error}"
        self.chat.note(self.policy_error, "error")
        self.refresh_status()

    def runtime_ready(self, policy: Any, error: str | None, store: Any) -> None:
        self.store, self.policy_error = store, error
        self.policy, self.subscriber = runner.follow(policy, self.settings, store)
        self.gate = ApprovalGate(ApprovalStore(store.home), self.workspace,
                                 self.settings.approval, ask=self._ask_from_thread)
        if error:
            self.chat.note(error, "error")
        self.refresh_status()
        if self.pending is not None and policy is not None:
            prompt, self.pending = self.pending, None
            self.start(prompt)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """esc is offered while a run is in progress; sessions and new session when idle."""
        if action == "cancel":
            return self.running
        if action in ("sessions", "new_session"):
            return None if self.running else True
        return True

    # -- status ----------------------------------------------------------------------------

    def refresh_status(self) -> None:
        """Footer fields: model, policy version, learner, approval mode, context meter."""
        if self.policy is not None:
            model = (f"model {runner.display_name(self.policy.name)} · "
                     f"v{self.policy.version}")
        elif self.policy_error:
            model = "model: none (" + self.policy_error.splitlines()[0] + ")"
        else:
            model = f"model {runner.display_name(self.settings.spec)} · loading…"
        learner = runner.learner_status(self.settings, self.policy, self.subscriber,
                                        self.learner_line)
        self._set(self.status_model, f"{model} · learner {learner}")
        mode = self.gate.mode if self.gate else self.settings.approval
        self._set(self.status_right, f"approvals: {mode} · {self._meter()}")
        self._set(self.activity, "● working · esc to cancel" if self.running else "")
        if getattr(self, "_bindings_running", None) != self.running:
            self._bindings_running = self.running
            self.refresh_bindings()

    @staticmethod
    def _set(widget: Static, text: str) -> None:
        if getattr(widget, "_shown", None) != text:
            widget._shown = text
            widget.update(text)

    def _meter(self, width: int = 10) -> str:
        window = getattr(self.policy, "context_window", None)
        if not window:
            return "context –"
        used = self.context_used or 0
        filled = min(width, round(width * used / window))
        return f"context {'▰' * filled}{'▱' * (width - filled)} {_k(used)}/{_k(window)}"

    # -- prompts and runs ------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.running:
            self.notify("the agent is still working; press esc to cancel it first",
                        severity="warning")
            return
        event.input.value = ""
        if self.policy_error:
            self.chat.add_user(prompt)
            self.chat.note(self.policy_error, "error")
        elif self.gate is None:                # still loading: send it once ready
            self.chat.add_user(prompt)
            self.chat.note("loading the model; your message is sent when it is ready", "dim")
            self.pending = prompt
        else:
            self.chat.add_user(prompt)
            self.start(prompt)

    def start(self, prompt: str) -> None:
        """Run the agent on `prompt` (already shown in the chat)."""
        self.running = True
        self.gate.cancel_event.clear()
        self.refresh_status()
        self.run_agent(prompt, self.session_id)

    @work(thread=True, exit_on_error=False, group="agent")
    def run_agent(self, prompt: str, session_id: str | None) -> None:
        """The agent's thread: one run (or resume) to its end; never raises."""
        try:
            from agent_runtime.agent import Agent, AgentConfig
            from agent_runtime.hooks import plugin_tools
            from agent_runtime.learning import session_learns
            learn = session_learns(self.store.home, self.workspace, self.settings.learn)
            agent = Agent(self.policy, tools=gated(plugin_tools(self.workspace), self.gate),
                          store=self.store,
                          workspace=self.workspace,
                          config=AgentConfig(max_steps=self.settings.max_steps, learn=learn),
                          callbacks=self._callbacks(), cancel_event=self.gate.cancel_event)
            self.agent = agent
            if not self._sandbox_checked:
                self._sandbox_checked = True
                warning = self.sandbox_warning(agent)
                if warning:
                    self._post(self.chat.note, warning, "warn")
            if session_id is None:
                result = agent.run(prompt)
            else:
                result = agent.resume(session_id, message=prompt)
            self._post(self._run_done, result)
        except BaseException:                  # a bug before or around the loop: show it
            self._post(self._run_crashed, traceback.format_exc())

    def sandbox_warning(self, agent: Any) -> str | None:
        """Why commands will run unconfined, or None when the sandbox works."""
        sandbox = agent.sandbox
        if sandbox is not None and sandbox.probe():
            return None
        return (getattr(sandbox, "warning", None)
                or "warning: no sandbox available; commands run unconfined in the workspace")

    def _callbacks(self) -> Any:
        """The agent's callbacks: each posts to the UI thread, streamed text in batches."""
        from agent_runtime.agent import Callbacks
        text = TextBatcher(lambda chunk: self._post(self.chat.stream, chunk))

        def post(fn: Callable[..., Any], *args: Any) -> None:
            text.flush()                       # text before the event that follows it
            self._post(fn, *args)

        return Callbacks(
            on_text=text.add,
            on_message=lambda mid, message: post(self.agent_message, mid, message),
            on_tool_start=lambda call: post(self.chat.tool_start, call.id, call.name,
                                            call.arguments if call.arguments is not None
                                            else call.raw),
            on_tool_end=lambda call, out: post(self.chat.tool_end, call.id, out.text, out.ok,
                                               out.data),
            on_summarize=lambda segment, summary: post(self.chat.summary, segment, summary),
            on_sample=lambda sid, completion: post(self.agent_sample, completion))

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the UI thread and wait for it; a no-op once the app closes."""
        if self.closing_down:
            return
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:
            if not self.closing_down and self.is_running:
                raise

    def agent_message(self, message_id: int, message: dict) -> None:
        if self.agent is not None and self.agent.session_id:
            self.session_id = self.agent.session_id
        if message["role"] == "assistant":
            self.chat.assistant(message_id, message.get("content") or "")
        elif message["role"] == "user" and message.get("kind") == names.KIND_NUDGE:
            self.chat.note("(no tool call: nudged to continue)", "dim")

    def agent_sample(self, completion: Any) -> None:
        self.context_used = len(completion.prompt_ids) + len(completion.completion_ids)
        self.refresh_status()

    def _run_done(self, result: Any) -> None:
        self.running = False
        self.session_id = result.session_id
        self.chat.current = None
        template, kind = END_NOTES.get(result.status, ("{status}: {summary}", "info"))
        self.chat.note(template.format(summary=result.summary or "", status=result.status), kind)
        if result.error:
            self.chat.note(result.error.rstrip(), "trace")
        self.refresh_status()

    def _run_crashed(self, trace: str) -> None:
        self.running = False
        self.chat.current = None
        self.chat.note("✘ the agent crashed; the session is kept as far as it got", "error")
        self.chat.note(trace.rstrip(), "trace")
        self.refresh_status()

    # -- approvals -------------------------------------------------------------------------

    def _ask_from_thread(self, request: Request, reply: Callable[[str | None], None]) -> None:
        self._post(self.ask_approval, request, reply)

    def ask_approval(self, request: Request, reply: Callable[[str | None], None]) -> None:
        self.chat.waiting(request.tool, True)

        def answered(answer: str | None) -> None:
            self.chat.waiting(request.tool, False)
            reply(answer)

        self.push_screen(ApprovalScreen(request, self.workspace), answered)

    def action_cycle_approval(self) -> None:
        if self.gate is None:
            return
        self.gate.mode = MODES[(MODES.index(self.gate.mode) + 1) % len(MODES)]
        self.notify(f"approvals: {self.gate.mode}", timeout=2)
        self.refresh_status()

    # -- cancel, sessions ------------------------------------------------------------------

    def action_cancel(self) -> None:
        if not self.running:
            self.action_focus_input()
            return
        self.gate.cancel_event.set()
        if isinstance(self.screen, ApprovalScreen):
            self.screen.dismiss(None)
        self.chat.note("cancelling…", "dim")

    def action_focus_input(self) -> None:
        self.prompt.focus()

    def action_new_session(self) -> None:
        if self.running:
            self.notify("the agent is working; esc cancels it", severity="warning")
            return
        self.session_id, self.context_used = None, None
        self.chat.clear()
        self.chat.note(INTRO, "dim")
        self.refresh_status()

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        mode = self.gate.mode if self.gate else self.settings.approval
        self.push_screen(HelpScreen(f"approvals now: {mode} · workspace "
                                    f"{runner.short_path(self.workspace)}"))

    def action_sessions(self) -> None:
        if self.running or self.store is None:
            self.notify("the agent is working; esc cancels it" if self.running
                        else "the session store is not open yet", severity="warning")
            return
        here = str(self.workspace)
        rows = [s for s in self.store.list_sessions(limit=500) if s["workspace"] == here]
        self.push_screen(SessionsScreen(rows, runner.short_path(self.workspace)),
                         self.open_session)

    def open_session(self, session_id: str | None) -> None:
        if not session_id:
            return
        store = self.store
        session = store.get_session(session_id)
        self.session_id = session["id"]
        self.chat.load(store.messages(session_id), store.tool_calls(session_id),
                       store.segments(session_id))
        row = store.db.execute("SELECT n_prompt + n_completion FROM samples WHERE session_id = ? "
                               "ORDER BY id DESC LIMIT 1", [session["id"]]).fetchone()
        self.context_used = row[0] if row else None
        self.chat.note(f"resumed session · {session['status']} · write to continue it", "dim")
        self.refresh_status()
        self.action_focus_input()

    # -- ratings ---------------------------------------------------------------------------

    def on_assistant_message_rate(self, event: AssistantMessage.Rate) -> None:
        widget = event.widget
        if widget.message_id is None or self.session_id is None:
            self.notify("this message is still being written", severity="warning")
            return
        self.push_screen(FeedbackScreen(event.rating, "this message"),
                         lambda answer: self._rated(answer, widget))

    def action_rate_session(self, rating: int) -> None:
        if self.session_id is None:
            self.notify("no session to rate yet", severity="warning")
            return
        if isinstance(self.screen, (FeedbackScreen, ApprovalScreen, SessionsScreen)):
            return
        self.push_screen(FeedbackScreen(rating, "this session"),
                         lambda answer: self._rated(answer, None))

    def _rated(self, answer: dict | None, widget: AssistantMessage | None) -> None:
        if answer is None:
            self.notify("rating cancelled: nothing recorded", timeout=3)
            return
        self.record_feedback(self.session_id, widget, **answer)

    @work(thread=True, exit_on_error=False, group="feedback")
    def record_feedback(self, session_id: str, widget: AssistantMessage | None, rating: int,
                        reason: str | None, comment: str | None) -> None:
        try:
            self.store.add_feedback(rating, session_id=session_id,
                                    message_id=widget.message_id if widget else None,
                                    reason=reason, source="explicit", comment=comment)
        except Exception as exc:
            self._post(self.notify, f"feedback not recorded: {exc}", severity="error")
            return
        if widget is not None:
            self._post(widget.mark_rated, rating, reason)
        what = "message" if widget else "session"
        self._post(self.notify, f"feedback on the {what} recorded, thank you", timeout=3)

    # -- leaving ---------------------------------------------------------------------------

    async def action_quit(self) -> None:
        """Stop a run in progress (the session is kept) before leaving."""
        if self.running and self.gate is not None:
            self.gate.cancel_event.set()
            if isinstance(self.screen, ApprovalScreen):
                self.screen.dismiss(None)
            workers = [w for w in self.workers if w.group == "agent" and not w.is_finished]
            for worker in workers:
                try:
                    await asyncio.wait_for(worker.wait(), timeout=5)
                except Exception:
                    pass
        self.closing_down = True
        if self.subscriber is not None:
            self.subscriber.stop()
        self.exit()

    def on_unmount(self) -> None:
        self.closing_down = True
        if self.gate is not None:
            self.gate.cancel_event.set()


class TextBatcher:
    """Hands streamed text on at most every `interval` seconds (the agent's thread waits for
    each hand-over, so a fast model must not wait for a screen update per token)."""

    def __init__(self, send: Callable[[str], None], interval: float = 0.03):
        self.send, self.interval = send, interval
        self.chunks: list[str] = []
        self.sent_at = float("-inf")

    def add(self, text: str) -> None:
        self.chunks.append(text)
        if time.monotonic() - self.sent_at >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self.chunks:
            text, self.chunks = "".join(self.chunks), []
            self.sent_at = time.monotonic()
            self.send(text)


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)
