"""Shared pieces of the TUI tests: a calc workspace, scripted policies, waiting helpers."""

from __future__ import annotations

import json
import time
from pathlib import Path

from agent_runtime.policies import Completion
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore
from tui.app import ApprenticeApp
from tui.runner import Settings

CALC = '''"""A tiny calculator."""


def add(a, b):
    return a - b


def multiply(a, b):
    return a * b
'''

TEST_CALC = '''from calc import add, multiply

assert add(2, 3) == 5, add(2, 3)
assert multiply(2, 3) == 6
print("all tests passed")
'''


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


READ = "Let me look at the code first.\n" + call("read_file", path="calc.py")
EDIT = ("`add` subtracts instead of adding.\nFixing it now.\n"
        + call("edit_file", path="calc.py", old="return a - b", new="return a + b"))
TEST = "Now I run the tests.\n" + call("run_command", command="python3 test_calc.py")
FINISH = "Done.\n" + call("finish", summary="Fixed add in calc.py; the tests pass.")


def make_workspace(root: Path) -> Path:
    ws = root / "calc"
    ws.mkdir()
    (ws / "calc.py").write_text(CALC)
    (ws / "test_calc.py").write_text(TEST_CALC)
    return ws


def make_app(workspace: Path, script: list, *, approval: str = "ask", policy=None,
             **settings) -> ApprenticeApp:
    policy = policy or ReplayPolicy(script, name="replay:calc.json")
    return ApprenticeApp(Settings(workspace=workspace, approval=approval, **settings),
                         policy=policy, store=SessionStore())


class SlowReplay(ReplayPolicy):
    """The scripted policy, streaming word by word with a pause, and stoppable mid-turn."""

    def __init__(self, script: list, pause: float = 0.05, **kw):
        super().__init__(script, name="replay:slow.json", **kw)
        self.pause = pause

    def complete(self, messages, tools=None, *, max_new_tokens=None, on_text=None,
                 should_stop=None) -> Completion:
        full = super().complete(messages, tools, max_new_tokens=max_new_tokens)
        words = full.text.split(" ")
        for n, word in enumerate(words):
            if should_stop is not None and should_stop():
                text = " ".join(words[:n])
                ids = self.tokenizer.encode(text, special=True)
                return Completion(text, full.prompt_ids, ids, [0.0] * len(ids),
                                  finish_reason="cancelled", version=self.version)
            if on_text is not None:
                on_text(word + (" " if n < len(words) - 1 else ""))
            time.sleep(self.pause)
        return full


def plain(widget) -> str:
    """The text a Static shows (a rich renderable, printed without styles)."""
    import io

    from rich.console import Console
    console = Console(width=200, file=io.StringIO(), color_system=None)
    content = widget.content
    console.print(content if not isinstance(content, str) else content, markup=False)
    return console.file.getvalue()


async def wait_for(pilot, predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    """Type a prompt into the chat input and press enter."""
    prompt = pilot.app.query_one("#prompt")
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")


async def until_idle(pilot) -> None:
    """Wait for the agent's run to end and the UI to settle."""
    await wait_for(pilot, lambda: not pilot.app.running, what="the run to end")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
