"""Modal screens: the approval prompt, the feedback dialog and the session list.

Each screen only collects an answer and dismisses with it; the app decides what the answer
does (release a tool call, write a feedback row, load a session).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from agent_runtime import names
from agent_runtime.approvals import ALWAYS, NO, YES, Request
from tui.widgets import preview

REASONS = {                                    # DESIGN.md's feedback reasons, as the user reads them
    "misunderstood": "misunderstood what I asked",
    "wrong_change": "made a wrong change",
    "unnecessary_change": "changed something it should not have",
    "should_ask": "should have asked me first",
    "incomplete": "stopped before the job was done",
    "other": "something else",
}


class ApprovalScreen(ModalScreen[str]):
    """Allow a command or a file change? y: yes, a: always (this workspace), n / Esc: no."""

    BINDINGS = [
        Binding("y", "answer('yes')", "yes"),
        Binding("a", "answer('always')", "always"),
        Binding("n,escape", "answer('no')", "no"),
    ]

    def __init__(self, request: Request, workspace: Path | None = None):
        super().__init__(classes="dialog-screen")
        self.request, self.workspace = request, workspace

    def compose(self) -> ComposeResult:
        what = "run this command" if self.request.tool == "run_command" else "change this file"
        with Vertical(id="approval", classes="dialog"):
            yield Static(f"Allow apprentice to {what}?", classes="dialog-title")
            if self.request.unconfined:
                yield Static("No sandbox: this command runs with your permissions "
                             "(APPRENTICE_SANDBOX=off stops these questions in full-auto).",
                             classes="note -warn")
            with VerticalScroll(classes="approval-preview"):
                yield Static(preview(self.request.tool, self.request.arguments, self.workspace))
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="success")
                yield Button(f"Yes, {self.request.always_label} (a)", id="always",
                             variant="primary")
                yield Button("No, tell it to do something else (n)", id="no", variant="error")

    def on_mount(self) -> None:
        self.query_one("#yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id)

    def action_answer(self, answer: str) -> None:
        assert answer in (YES, ALWAYS, NO)
        self.dismiss(answer)


class FeedbackScreen(ModalScreen[dict | None]):
    """Rate a message or the session: an optional reason (down ratings) and a comment.

    Enter on a reason sends with that reason (tab first to add a comment); Enter in the
    comment (or ctrl+s) sends with the highlighted reason; Esc closes without recording
    anything, and the app says so."""

    BINDINGS = [
        Binding("escape", "cancel", "cancel"),
        Binding("ctrl+s", "submit", "send"),
    ]

    def __init__(self, rating: int, target: str):
        super().__init__(classes="dialog-screen")
        self.rating, self.target = rating, target
        self.reason: str | None = None

    def compose(self) -> ComposeResult:
        thumb = "Thumbs up (+1)" if self.rating > 0 else "Thumbs down (-1)"
        with Vertical(id="feedback", classes="dialog"):
            yield Static(f"{thumb} on {self.target}", classes="dialog-title")
            if self.rating < 0:
                yield Static("What went wrong? (optional)", classes="dialog-label")
                options = [Option(Text("no particular reason", style="dim"), id="")]
                options += [Option(f"{text}  [dim]({key})[/]", id=key)
                            for key, text in REASONS.items()]
                yield OptionList(*options, id="reasons")
            yield Static("Comment (optional)", classes="dialog-label")
            yield Input(placeholder="anything the agent should learn from this",
                        id="comment")
            with Horizontal(classes="buttons"):
                yield Button("Send (enter)", id="send", variant="primary")
                yield Button("Cancel (esc)", id="cancel")
            hint = "enter: send · tab: add a comment first · " if self.rating < 0 else "enter: send · "
            yield Static(hint + "esc: cancel (nothing recorded)", classes="dialog-hint")

    def on_mount(self) -> None:
        if self.rating < 0:
            self.query_one("#reasons", OptionList).focus()
        else:
            self.query_one("#comment", Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.reason = event.option.id or None
        self.action_submit()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "send":
            self.action_submit()
        else:
            self.action_cancel()

    def action_submit(self) -> None:
        if self.rating < 0 and self.reason is None:
            options = self.query_one("#reasons", OptionList)
            if options.highlighted is not None:
                self.reason = options.get_option_at_index(options.highlighted).id or None
        comment = self.query_one("#comment", Input).value.strip()
        self.dismiss({"rating": self.rating, "reason": self.reason, "comment": comment or None})

    def action_cancel(self) -> None:
        self.dismiss(None)


class SessionsScreen(ModalScreen[str | None]):
    """This workspace's sessions, newest first; Enter opens one to continue it."""

    BINDINGS = [Binding("escape", "cancel", "close")]

    def __init__(self, sessions: list[dict], workspace_label: str):
        super().__init__(classes="dialog-screen")
        self.sessions, self.workspace_label = sessions, workspace_label

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions", classes="dialog"):
            yield Static(f"Sessions in {self.workspace_label}", classes="dialog-title")
            if not self.sessions:
                yield Static("No sessions in this workspace yet.", classes="dialog-label")
            options = [Option(self._label(s), id=s["id"]) for s in self.sessions]
            yield OptionList(*options, id="session-list")
            yield Static("enter: open and continue · esc: close", classes="dialog-hint")

    @staticmethod
    def _label(session: dict) -> Text:
        task = (session.get("task") or "").strip().splitlines()
        when = (session.get("created_at") or "")[:16].replace("T", " ")
        label = Text(f"{when}  ", style="dim")
        status = "interrupted" if session.get("interrupted") else session.get("status", "")
        label.append(f"{status:<16}", style=_STATUS_STYLE.get(status, ""))
        label.append(f"{session.get('message_count', 0):>4} msgs  ", style="dim")
        label.append(task[0][:80] if task else "(no task)")
        return label

    def on_mount(self) -> None:
        self.query_one("#session-list", OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


_STATUS_STYLE: dict[str, Any] = {names.FINISHED: "green", names.FAILED: "red",
                                 names.RUNNING: "yellow", names.CANCELLED: "magenta",
                                 names.BUDGET_EXHAUSTED: "yellow",
                                 "interrupted": "red"}       # running, its process gone


HELP = [
    ("Writing", [("enter", "send the task or message"),
                 ("↑ (empty input)", "go to the messages, to rate them")]),
    ("On a message", [("+ / -", "rate it up or down"), ("↑ / ↓", "previous / next message"),
                      ("enter or i", "back to the input"), ("esc", "back to the input")]),
    ("Anywhere", [("esc", "cancel the run in progress (the session is kept)"),
                  ("ctrl+u / ctrl+d", "rate the whole session up / down"),
                  ("ctrl+r", "sessions in this workspace: open one to continue it"),
                  ("ctrl+n", "new session"),
                  ("ctrl+t", "approvals: ask → auto-edit → full-auto"),
                  ("f1 or ?", "this help"), ("ctrl+q", "quit")]),
    ("When asked", [("y", "allow once"), ("a", "always allow (this workspace)"),
                    ("n or esc", "refuse: the agent is told to do something else")]),
]


class HelpScreen(ModalScreen[None]):
    """The keys, grouped by where they work; any of esc, f1, ? or q closes it."""

    BINDINGS = [Binding("escape,f1,question_mark,q", "close", "close")]

    def __init__(self, status: str = ""):
        super().__init__(classes="dialog-screen")
        self.status = status

    def compose(self) -> ComposeResult:
        text = Text()
        for group, keys in HELP:
            text.append(f"{group}\n", style="bold")
            for key, what in keys:
                text.append(f"  {key:<18}", style="cyan")
                text.append(f"{what}\n")
        with Vertical(id="help", classes="dialog"):
            yield Static("apprentice: keys", classes="dialog-title")
            with VerticalScroll():
                yield Static(text)
            if self.status:
                yield Static(self.status, classes="dialog-hint")
            yield Static("esc: close", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
