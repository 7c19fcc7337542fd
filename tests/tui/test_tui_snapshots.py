"""Snapshots of the main screen, a tool panel with a diff, the approval prompt and the
feedback dialog (pytest-textual-snapshot; review the SVGs before `--snapshot-update`).

Deterministic by construction: a fixed terminal size, $HOME set so the workspace shows as
~/calc, a replay policy with a fixed name and fixed prompt sizes (so the context meter does
not move when the system prompt changes), no sandbox notice, no cursor blink.
"""

import pytest

from agent_runtime.policies.replay import ReplayPolicy
from tui.app import ApprenticeApp
from tui.screens import ApprovalScreen
from tui_support import EDIT, FINISH, READ, TEST, make_app, send, until_idle, wait_for

SIZE = (100, 32)


class FixedSizePolicy(ReplayPolicy):
    """The scripted policy with prompts of a fixed, growing size."""

    def encode_prompt(self, messages, tools=None):
        return [0] * (2000 + 150 * len(messages))


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(ApprenticeApp, "sandbox_warning", lambda self, agent: None)


def app_for(workspace, script, approval="ask"):
    return make_app(workspace, [], approval=approval,
                    policy=FixedSizePolicy(script, name="replay:calc.json"))


async def ready(pilot):
    await wait_for(pilot, lambda: pilot.app.gate is not None, what="the store and policy")
    pilot.app.prompt.cursor_blink = False
    await pilot.pause()


def test_main_screen(snap_compare, workspace):
    assert snap_compare(app_for(workspace, []), terminal_size=SIZE, run_before=ready)


def test_tool_panel_with_a_diff(snap_compare, workspace):
    async def run(pilot):
        await ready(pilot)
        await send(pilot, "add(2, 3) returns -1; fix it")
        await until_idle(pilot)

    app = app_for(workspace, [EDIT, FINISH], approval="full-auto")
    assert snap_compare(app, terminal_size=SIZE, run_before=run)


def test_approval_prompt(snap_compare, workspace):
    async def run(pilot):
        await ready(pilot)
        await send(pilot, "run the tests")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApprovalScreen))

    assert snap_compare(app_for(workspace, [TEST, FINISH]), terminal_size=SIZE, run_before=run)


def test_feedback_dialog(snap_compare, workspace):
    async def run(pilot):
        await ready(pilot)
        await send(pilot, "what does calc.py do?")
        await until_idle(pilot)
        await pilot.press("up", "minus", "down", "down")

    assert snap_compare(app_for(workspace, [READ, FINISH]), terminal_size=SIZE, run_before=run)
