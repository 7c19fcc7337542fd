"""The transcript's widgets: user and assistant messages, tool panels, notes, summary marks,
and `ChatLog`, the scrolling column that holds them.

`ChatLog` is the one place that turns agent events (streamed text, messages, tool calls,
summaries) and stored sessions into widgets; it runs on the UI thread only. It neither runs
the agent nor writes to the store.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from agent_runtime import names
from agent_runtime.toolcalls import visible_text

RESULT_LINES = 40                              # lines of a tool result shown in a panel
OPEN_PANELS = {"edit_file", "write_file", "run_command"}   # shown expanded
SYNTAX_THEME = "monokai"


def _syntax(code: str, lexer: str) -> Any:
    from rich.syntax import Syntax             # pygments: imported on first use, not at start
    return Syntax(code, lexer, theme=SYNTAX_THEME, word_wrap=True)


def clip(text: str, lines: int = RESULT_LINES) -> str:
    """Head and tail of a long text, with a count of what was left out."""
    rows = text.rstrip("\n").splitlines()
    if len(rows) <= lines:
        return "\n".join(rows)
    head, tail = rows[: lines // 2], rows[-(lines - lines // 2):]
    return "\n".join(head + [f"… ({len(rows) - len(head) - len(tail)} more lines)"] + tail)


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def call_label(name: str | None, arguments: Any) -> str:
    """One line naming a call: `edit_file calc.py`, `$ pytest -q`, `grep 'add'`."""
    args = arguments if isinstance(arguments, dict) else {}
    if name == "run_command":
        return "$ " + _short(args.get("command", ""), 70)
    for key in ("path", "pattern", "query", "summary"):
        if key in args:
            return f"{name} {_short(args[key])}"
    if not name:
        return "invalid tool call"
    return f"{name} {_short(args)}" if args else name


def planned_diff(name: str | None, arguments: Any, workspace: Path) -> str | None:
    """The unified diff (3 lines of context, real line numbers) an `edit_file` or a
    `write_file` over an existing file would make, computed from the file as it is now; None
    when it cannot be told (no such file, `old` not found, a path outside the workspace)."""
    args = arguments if isinstance(arguments, dict) else {}
    path = args.get("path")
    if name not in ("edit_file", "write_file") or not isinstance(path, str) or not path:
        return None
    target = (workspace / path).resolve()
    if not target.is_relative_to(workspace.resolve()) or not target.is_file():
        return None
    try:
        before = target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if name == "write_file":
        after = args.get("content")
        if not isinstance(after, str):
            return None
    else:
        old, new = args.get("old"), args.get("new")
        if not isinstance(old, str) or not isinstance(new, str) or not old or old not in before:
            return None
        after = before.replace(old, new) if args.get("replace_all") else before.replace(old, new, 1)
    diff = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in diff)


def preview(name: str | None, arguments: Any, workspace: Path | None = None) -> Any:
    """What a call is about to do: a diff for edits (against the file as it is, when
    `workspace` is given), the content for writes, the command."""
    args = arguments if isinstance(arguments, dict) else {}
    diff = planned_diff(name, arguments, workspace) if workspace is not None else None
    if diff is not None:
        return _syntax(clip(diff, 80), "diff")
    if name == "edit_file" and isinstance(args.get("old"), str) and isinstance(args.get("new"), str):
        path = args.get("path", "")
        lines = [f"--- {path}", f"+++ {path}"]
        lines += ["-" + line for line in args["old"].splitlines()]
        lines += ["+" + line for line in args["new"].splitlines()]
        return _syntax("\n".join(lines), "diff")
    if name == "write_file" and isinstance(args.get("content"), str):
        path = str(args.get("path", ""))
        from rich.syntax import Syntax
        return _syntax(clip(args["content"], 30), Syntax.guess_lexer(path, args["content"]))
    if name == "run_command":
        return Text("$ " + str(args.get("command", "")), style="bold")
    if not isinstance(arguments, dict):
        return Text(str(arguments))
    return Text("\n".join(f"{k}: {_short(v, 200)}" for k, v in args.items()))


def result_view(name: str | None, text: str, ok: bool, data: dict | None) -> Any:
    """A finished call's result: a highlighted diff for edits, the output for the rest."""
    data = data or {}
    if ok and data.get("diff"):
        return _syntax(clip(data["diff"], 80), "diff")
    shown = Text(clip(text))
    if not ok:
        shown.stylize("red")
    elif name == "run_command":
        code = data.get("exit_code")
        last = shown.plain.rfind("\n") + 1
        shown.stylize("dim", 0, last)
        shown.stylize("green" if code == 0 else "bold red", last)
    else:
        shown.stylize("dim")
    return shown


# --- status of a tool call ----------------------------------------------------------------

STATUS = {
    "running": "[yellow]⋯[/]",
    "waiting": "[bold yellow]? awaiting approval[/]",
    "ok": "[green]✔[/]",
    "failed": "[red]✘[/]",
    "declined": "[magenta]⊘ declined[/]",
    "cancelled": "[dim]⊘ not run[/]",
    "unknown": "[dim]·[/]",
}


def outcome_status(ok: bool | None, text: str) -> str:
    if ok is None:
        return "unknown"
    if ok:
        return "ok"
    if text.startswith("Not run: the user declined"):
        return "declined"
    if text.startswith("Not run:"):
        return "cancelled"
    return "failed"


class ToolPanel(Collapsible):
    """One tool call: status and a short label in the title; arguments and result inside."""

    def __init__(self, call_id: str | None, name: str | None, arguments: Any):
        self.call_id, self.tool_name, self.arguments = call_id, name, arguments
        self.args_view = Static(preview(name, arguments), classes="tool-args")
        # a short one-line command is all in the title already: not again in the body
        command = (arguments or {}).get("command") if isinstance(arguments, dict) else None
        self.args_view.display = not (name == "run_command" and isinstance(command, str)
                                      and "\n" not in command and len(command) < 70)
        self.result = Static("", classes="tool-result")
        self.result.display = False
        self.status = "running"
        super().__init__(self.args_view, self.result, title=self.label_markup(),
                         collapsed=name not in OPEN_PANELS, classes="tool-panel")

    def label_markup(self) -> str:
        return f"{STATUS[self.status]} {escape(call_label(self.tool_name, self.arguments))}"

    def set_status(self, status: str) -> None:
        self.status = status
        self.title = self.label_markup()
        self.set_class(status == "waiting", "-waiting")

    def finish(self, text: str, ok: bool | None, data: dict | None) -> None:
        status = outcome_status(ok, text)
        if ok and (data or {}).get("diff"):
            self.args_view.display = False     # the real diff replaces the preview
        self.result.update(result_view(self.tool_name, text, bool(ok), data))
        self.result.display = True
        self.set_status(status)


# --- messages -------------------------------------------------------------------------------

class MarkdownBody(Widget):
    """Assistant text rendered as Markdown; re-rendered once per frame while streaming."""
    text: reactive[str] = reactive("", layout=True)

    def render(self) -> Any:
        if not self.text:
            return ""
        from rich.markdown import Markdown     # markdown-it: imported on first use
        return Markdown(self.text, code_theme=SYNTAX_THEME)


class Thumb(Static):
    """A clickable thumbs up (+1) / thumbs down (-1) on a message."""

    def __init__(self, rating: int):
        super().__init__("+1" if rating > 0 else "-1", classes="thumb")
        self.rating = rating
        self.tooltip = "rate this message " + ("up (+)" if rating > 0 else "down (-)")

    def on_click(self, event: Any) -> None:
        event.stop()
        message = next(a for a in self.ancestors if isinstance(a, AssistantMessage))
        message.post_message(AssistantMessage.Rate(message, self.rating))


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(Text(text), classes="user-message")


class AssistantMessage(Vertical, can_focus=True):
    """An assistant turn: its text and the panels of the tool calls it made. Rate it with
    + / - when focused (↑/↓ move between messages), or click a thumb."""

    BINDINGS = [
        Binding("plus,equals_sign", "rate(1)", "+1 message"),
        Binding("minus", "rate(-1)", "-1 message"),
        Binding("up", "move(-1)", "previous", show=False),
        Binding("down", "move(1)", "next", show=False),
        Binding("enter,i", "app.focus_input", "write", show=False),
        Binding("escape", "leave", "back", show=False),
    ]

    class Rate(Message):
        """The user asked to rate `widget` (+1 / -1)."""

        def __init__(self, widget: "AssistantMessage", rating: int):
            super().__init__()
            self.widget, self.rating = widget, rating

    def __init__(self, text: str = "", message_id: int | None = None):
        super().__init__(classes="assistant-message")
        self.raw = text
        self.message_id = message_id
        self.body = MarkdownBody(classes="body")
        self.body.text = text
        self.rated = Static("", classes="rated")
        self.panels: dict[str, ToolPanel] = {}

    def compose(self) -> ComposeResult:
        with Horizontal(classes="header"):
            yield Static("apprentice", classes="who")
            yield self.rated
            yield Thumb(1)
            yield Thumb(-1)
        yield self.body

    def stream(self, chunk: str) -> None:
        self.raw += chunk
        self.body.text = visible_text(self.raw)

    def finalize(self, message_id: int, content: str) -> None:
        self.message_id = message_id
        self.body.text = (content or "").strip()
        self.set_class(not self.body.text, "-no-text")

    def mark_rated(self, rating: int, reason: str | None) -> None:
        self.rated.update(("rated +1" if rating > 0 else "rated -1")
                          + (f" · {reason}" if reason else ""))

    def action_rate(self, rating: int) -> None:
        self.post_message(self.Rate(self, rating))

    def action_leave(self) -> None:
        """esc: cancel the run in progress, else back to the input."""
        if getattr(self.app, "running", False):
            self.app.action_cancel()
        else:
            self.app.action_focus_input()

    def action_move(self, delta: int) -> None:
        messages = list(self.screen.query(AssistantMessage))
        index = messages.index(self) + delta
        if 0 <= index < len(messages):
            messages[index].focus()
            messages[index].scroll_visible()
        elif delta > 0:
            self.app.action_focus_input()


class Note(Static):
    """A line from the app itself: run results, warnings, errors, nudges."""

    def __init__(self, text: str, kind: str = "info"):
        super().__init__(Text(text), classes=f"note -{kind}")


class SummaryMark(Collapsible):
    """Where the context was summarized; the summary the agent continued from is inside."""

    def __init__(self, segment: int, summary: str):
        super().__init__(Static(Text(summary), classes="summary-text"),
                         title=f"context summarized · segment {segment} begins",
                         collapsed=True, classes="summary-mark")


# --- the transcript -------------------------------------------------------------------------

class ChatLog(VerticalScroll):
    """The transcript of the current session, live or loaded from the store."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.current: AssistantMessage | None = None   # the message being streamed
        self.last: AssistantMessage | None = None      # the message tool panels attach to
        self.panels: dict[str, ToolPanel] = {}

    def _add(self, widget: Widget, parent: Widget | None = None) -> Widget:
        follow = self.scroll_y >= self.max_scroll_y - 1
        (parent or self).mount(widget)
        if follow:
            self.call_after_refresh(self.scroll_end, animate=False)
        return widget

    def clear(self) -> None:
        self.remove_children()
        self.current = self.last = None
        self.panels = {}

    def add_user(self, text: str) -> None:
        self._add(UserMessage(text))

    def note(self, text: str, kind: str = "info") -> Note:
        return self._add(Note(text, kind))

    def summary(self, segment: int, summary: str) -> None:
        self._add(SummaryMark(segment, summary))

    def stream(self, chunk: str) -> None:
        if self.current is None:
            self.current = self._add(AssistantMessage())
        self.current.stream(chunk)
        if self.scroll_y >= self.max_scroll_y - 1:
            self.call_after_refresh(self.scroll_end, animate=False)

    def assistant(self, message_id: int, content: str) -> AssistantMessage:
        message = self.current or self._add(AssistantMessage())
        message.finalize(message_id, content)
        self.current, self.last = None, message
        return message

    def tool_start(self, call_id: str | None, name: str | None, arguments: Any) -> ToolPanel | None:
        if name == "finish":                   # the run's end note says it
            return None
        panel = ToolPanel(call_id, name, arguments)
        self._add(panel, self.last)
        if call_id:
            self.panels[call_id] = panel
        return panel

    def tool_end(self, call_id: str | None, text: str, ok: bool | None, data: dict | None) -> None:
        panel = self.panels.get(call_id or "")
        if panel is not None:
            panel.finish(text, ok, data)

    def waiting(self, tool: str, on: bool) -> None:
        """Mark the running panel of `tool` as waiting for approval (or running again)."""
        for panel in reversed(list(self.panels.values())):
            if panel.tool_name == tool and panel.status in ("running", "waiting"):
                panel.set_status("waiting" if on else "running")
                if on:
                    panel.scroll_visible()
                return

    def load(self, messages: list[dict], tool_calls: list[dict], segments: list[dict]) -> None:
        """Show a stored session: its messages, tool panels and summary marks."""
        self.clear()
        calls = {c["call_id"]: c for c in tool_calls}
        summaries = {s["idx"]: s["summary"] for s in segments}
        segment, answered = 0, True            # answered: an assistant turn seen in the segment
        for m in messages:
            kind = (m.get("meta") or {}).get("kind")
            if m["segment"] != segment:
                segment, answered = m["segment"], False
                self.summary(segment, summaries.get(segment) or "")
            if m["role"] == "user" and kind in (names.KIND_TASK, names.KIND_USER, None):
                if answered or segment == 0:   # not the message a summary carried over
                    self.add_user(m["content"])
            elif m["role"] == "user" and kind == names.KIND_NUDGE:
                self.note("(no tool call: nudged to continue)", "dim")
            elif m["role"] == "assistant" and kind != names.KIND_SUMMARY:
                answered = True
                message = self.assistant(m["id"], m["content"])
                for entry in m.get("tool_calls") or []:
                    fn = entry.get("function", {})
                    panel = self.tool_start(entry.get("id"), fn.get("name"), fn.get("arguments"))
                    row = calls.get(entry.get("id"))
                    if panel is not None and row is not None and row["result"] is not None:
                        panel.finish(row["result"], row["ok"], row["data"])
                    elif panel is not None:
                        panel.set_status("unknown")
                self.last = message
        self.call_after_refresh(self.scroll_end, animate=False)
