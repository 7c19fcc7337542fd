"""The app driven by Pilot over the scripted policy: streaming, tool panels, approvals,
ratings, cancel, resume, crashes. Each test checks one property against the real store."""

import json

import pytest

from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore
from tui.screens import ApprovalScreen, FeedbackScreen, SessionsScreen
from tui.widgets import AssistantMessage, Note, SummaryMark, ToolPanel
from tui_support import (EDIT, FINISH, READ, TEST, SlowReplay, call, make_app, plain, send,
                         until_idle, wait_for)

SIZE = (100, 40)


def notes(app) -> list[str]:
    return [plain(n) for n in app.query(Note)]


def panel(app, tool: str) -> ToolPanel:
    return next(p for p in app.query(ToolPanel) if p.tool_name == tool)


async def test_assistant_text_is_streamed_as_it_is_generated(workspace):
    app = make_app(workspace, [READ, FINISH], policy=SlowReplay([READ, FINISH], pause=0.04))
    async with app.run_test(size=SIZE) as pilot:
        chunks = []
        stream = app.chat.stream
        app.chat.stream = lambda chunk: (chunks.append(chunk), stream(chunk))
        await send(pilot, "fix add")
        await until_idle(pilot)
        message = app.query(AssistantMessage).first()
    assert len(chunks) > 5
    assert message.body.text == "Let me look at the code first."


async def test_edit_shows_a_panel_with_a_highlighted_diff(workspace):
    app = make_app(workspace, [EDIT, FINISH], approval="full-auto")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "fix add")
        await until_idle(pilot)
        edit = panel(app, "edit_file")
        assert edit.status == "ok" and not edit.collapsed
        shown = plain(edit.result)
    assert "return a + b" in (workspace / "calc.py").read_text()
    assert "-    return a - b" in shown and "+    return a + b" in shown


async def test_read_panels_start_collapsed(workspace):
    app = make_app(workspace, [READ, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "look")
        await until_idle(pilot)
        assert panel(app, "read_file").collapsed


async def test_command_waits_for_approval_and_runs_after_yes(workspace):
    app = make_app(workspace, [TEST, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "run the tests")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen), what="approval")
        assert panel(app, "run_command").status == "waiting"
        await pilot.press("y")
        await until_idle(pilot)
        run = panel(app, "run_command")
    assert run.status == "ok"
    assert "Traceback" in plain(run.result)      # the tests fail before the fix


async def test_declined_call_is_reported_to_the_model(workspace):
    app = make_app(workspace, [EDIT, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "fix add")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen), what="approval")
        await pilot.press("n")
        await until_idle(pilot)
        assert panel(app, "edit_file").status == "declined"
        session_id = app.session_id
    tool_messages = [m for m in SessionStore().messages(session_id) if m["role"] == "tool"]
    assert "the user declined" in tool_messages[0]["content"]
    assert "return a - b" in (workspace / "calc.py").read_text()


async def test_always_allow_persists_for_the_workspace(workspace, home):
    async with make_app(workspace, [TEST, FINISH]).run_test(size=SIZE) as pilot:
        await send(pilot, "run the tests")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApprovalScreen))
        await pilot.press("a")
        await until_idle(pilot)
    saved = json.loads((home / "approvals.json").read_text())
    assert saved[str(workspace.resolve())]["commands"] == ["python3 test_calc.py"]
    app = make_app(workspace, [TEST, FINISH])
    async with app.run_test(size=SIZE) as pilot:          # a new app: no question this time
        await send(pilot, "run them again")
        await until_idle(pilot)
        assert panel(app, "run_command").status == "ok"


async def test_auto_edit_mode_applies_edits_without_asking(workspace):
    app = make_app(workspace, [EDIT, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+t")                        # ask -> auto-edit
        assert app.gate.mode == "auto-edit"
        await send(pilot, "fix add")
        await until_idle(pilot)
        assert panel(app, "edit_file").status == "ok"


async def test_thumbs_down_with_reason_writes_a_feedback_row(workspace):
    app = make_app(workspace, [READ, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "look at calc")
        await until_idle(pilot)
        await pilot.press("up")                            # from the empty input to the messages
        await pilot.press("up")
        focused = app.focused
        assert isinstance(focused, AssistantMessage) and focused.body.text.startswith("Let me")
        await pilot.press("minus")
        assert isinstance(app.screen, FeedbackScreen)
        await pilot.press("down", "down", "tab")           # (none), misunderstood, wrong_change
        await pilot.press(*"nope")
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        rows = SessionStore().feedback(app.session_id)
        assert "rated -1" in plain(focused.rated)
    assert [(r["rating"], r["reason"], r["comment"], r["message_id"], r["source"]) for r in rows] \
        == [(-1, "wrong_change", "nope", focused.message_id, "explicit")]


async def test_enter_on_a_reason_sends_and_escape_says_nothing_was_recorded(workspace):
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "nothing to do")
        await until_idle(pilot)
        await pilot.press("ctrl+d")
        assert isinstance(app.screen, FeedbackScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, FeedbackScreen)
        assert any("nothing recorded" in n.message for n in app._notifications)
        assert SessionStore().feedback(app.session_id) == []
        await pilot.press("ctrl+d")
        await pilot.press("down", "enter")                 # misunderstood: sent at once
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert not isinstance(app.screen, FeedbackScreen)
        rows = SessionStore().feedback(app.session_id)
    assert [(r["rating"], r["reason"], r["message_id"]) for r in rows] == [(-1, "misunderstood", None)]


async def test_f1_and_question_mark_open_the_keys_and_the_footer_shows_quit(workspace):
    from tui.screens import HelpScreen
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")                 # in the input: just a character
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        shown = " ".join(plain(w) for w in app.screen.query("Static"))
        assert "ctrl+q" in shown and "rate the whole session" in shown
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await send(pilot, "nothing to do")
        await until_idle(pilot)
        await pilot.press("up")                            # to the messages: ? is help there
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        footer_keys = {b.binding.key for b in app.active_bindings.values() if b.binding.show}
    assert "ctrl+q" in footer_keys and "f1" in footer_keys


async def approval_text(pilot, app) -> str:
    """The approval dialog's text, once every part of it is mounted (the screen is the
    active one a few messages before its last children are: a loaded machine showed only
    the title)."""
    await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen)
                   and bool(app.screen.query("#no")), what="approval")
    return " ".join(plain(w) for w in app.screen.query("Static"))


async def test_the_approval_prompt_shows_the_edit_as_a_diff_of_the_file(workspace):
    app = make_app(workspace, [EDIT, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "fix add")
        shown = await approval_text(pilot, app)
        await pilot.press("n")
        await until_idle(pilot)
    assert "--- a/calc.py" in shown and "+++ b/calc.py" in shown and "@@ -" in shown
    assert "def add(a, b):" in shown                       # context around the change
    assert "-    return a - b" in shown and "+    return a + b" in shown


async def test_a_short_command_is_shown_once(workspace):
    app = make_app(workspace, [TEST, FINISH], approval="full-auto")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "run the tests")
        await until_idle(pilot)
        run = panel(app, "run_command")
        assert "python3 test_calc.py" in run.title and not run.args_view.display


async def test_without_bubblewrap_a_command_asks_even_in_full_auto(workspace, monkeypatch):
    import shutil
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap"
                        else which(name, *a, **k))
    app = make_app(workspace, [TEST, FINISH], approval="full-auto")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "run the tests")
        shown = await approval_text(pilot, app)
        assert "No sandbox: this command runs with your permissions" in shown
        await pilot.press("y")
        await until_idle(pilot)
        assert panel(app, "run_command").status == "ok"


async def test_session_thumbs_up_key_rates_the_whole_session(workspace):
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "nothing to do")
        await until_idle(pilot)
        await pilot.press("ctrl+u")
        assert isinstance(app.screen, FeedbackScreen)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        rows = SessionStore().feedback(app.session_id)
    assert [(r["rating"], r["message_id"], r["reason"]) for r in rows] == [(1, None, None)]


async def test_clicking_a_thumb_opens_the_feedback_dialog(workspace):
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "nothing to do")
        await until_idle(pilot)
        await pilot.click(".thumb")
        assert isinstance(app.screen, FeedbackScreen) and app.screen.rating == 1
        await pilot.press("escape")
        assert SessionStore().feedback(app.session_id) == []


async def test_escape_cancels_mid_generation_and_keeps_the_session(workspace):
    long_turn = " ".join(["word"] * 200) + "\n" + call("finish", summary="x")
    policy = SlowReplay([long_turn, FINISH], pause=0.01)
    app = make_app(workspace, [], policy=policy)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "write a lot")
        await wait_for(pilot, lambda: app.chat.current is not None
                       and app.chat.current.body.text.count("word") > 3, what="streaming")
        await pilot.press("escape")
        await until_idle(pilot)
        session_id = app.session_id
        assert SessionStore().get_session(session_id)["status"] == "cancelled"
        assert any("cancelled" in n for n in notes(app))
        await send(pilot, "go on")                         # the same session continues
        await until_idle(pilot)
        assert app.session_id == session_id
    store = SessionStore()
    assert store.get_session(session_id)["status"] == "finished"
    assert [m["content"] for m in store.messages(session_id) if m["role"] == "user"][-1] == "go on"


async def test_escape_while_asking_releases_the_call(workspace):
    app = make_app(workspace, [TEST, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "run the tests")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen))
        app.action_cancel()                                # esc on the app, not the dialog
        await until_idle(pilot)
        assert not isinstance(app.screen, ApprovalScreen)
        assert SessionStore().get_session(app.session_id)["status"] == "cancelled"


async def test_resume_a_previous_session(workspace):
    async with make_app(workspace, [READ, FINISH]).run_test(size=SIZE) as pilot:
        await send(pilot, "first task")
        await until_idle(pilot)
        first = pilot.app.session_id
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+r")
        assert isinstance(app.screen, SessionsScreen)
        await pilot.press("enter")
        await pilot.pause()
        assert app.session_id == first
        assert [p.tool_name for p in app.query(ToolPanel)] == ["read_file"]
        assert str(app.query(AssistantMessage).first().body.text).startswith("Let me look")
        await send(pilot, "and now?")
        await until_idle(pilot)
    users = [m["content"] for m in SessionStore().messages(first) if m["role"] == "user"]
    assert users[0] == "first task" and users[-1] == "and now?"


async def test_new_session_starts_fresh(workspace):
    app = make_app(workspace, [FINISH, FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one")
        await until_idle(pilot)
        first = app.session_id
        await pilot.press("ctrl+n")
        await send(pilot, "two")
        await until_idle(pilot)
        assert app.session_id != first
        assert len(SessionStore().list_sessions()) == 2


async def test_a_crash_in_the_policy_is_shown_not_fatal(workspace):
    class Broken(ReplayPolicy):
        def complete(self, *a, **kw):
            raise RuntimeError("the engine fell over")

    app = make_app(workspace, [], policy=Broken([], name="broken"))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "anything")
        await until_idle(pilot)
        assert any("RuntimeError: the engine fell over" in n for n in notes(app))
        assert app.is_running and app.query_one("#prompt").has_focus


async def test_a_crash_outside_the_loop_is_shown_not_fatal(workspace, monkeypatch):
    from agent_runtime.agent import Agent

    def broken_run(self, task):
        raise OSError("disk full")

    monkeypatch.setattr(Agent, "run", broken_run)
    app = make_app(workspace, [FINISH])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "anything")
        await until_idle(pilot)
        assert any("the agent crashed" in n for n in notes(app))
        assert any("OSError: disk full" in n for n in notes(app))


async def test_summarized_context_leaves_a_visible_mark(workspace):
    from agent_runtime.agent import Agent
    script = [READ, READ, READ, FINISH, {"summary": "## Goal\nread calc"}]
    probe = ReplayPolicy(script[:4])
    prompts = []
    complete = probe.complete
    probe.complete = lambda m, t=None, **kw: (prompts.append(probe.count_tokens(m, t)),
                                              complete(m, t, **kw))[1]
    Agent(probe, workspace=workspace).run("read it")     # measure the prompt of each step
    policy = ReplayPolicy(script, name="replay:calc.json")
    policy.context_window = int((prompts[1] + prompts[2]) / 2 / 0.8)   # summarize at step 3
    app = make_app(workspace, [], policy=policy, approval="full-auto")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "read it")
        await until_idle(pilot)
        marks = list(app.query(SummaryMark))
    assert len(marks) == 1 and "segment 1" in str(marks[0].title)


async def test_footer_shows_model_version_and_follows_version_changes(workspace):
    app = make_app(workspace, [])
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one("#status-model")
        assert "replay:calc.json · v0 · learner off" in plain(status)
        app.policy.version = 3
        await wait_for(pilot, lambda: "v3" in plain(status), what="version 3")


async def test_without_a_default_model_the_app_explains_and_stays_up(workspace, tmp_path,
                                                                    monkeypatch):
    from tui.app import ApprenticeApp
    from tui.runner import NO_DEFAULT_MODEL, Settings
    def load_policy(spec):          # what EnginePolicy.load("default") raises, without torch
        raise FileNotFoundError(f"no default model at {tmp_path}: this build ships none yet")

    monkeypatch.setattr("agent_runtime.policies.loading.load_policy", load_policy)
    app = ApprenticeApp(Settings(workspace=workspace))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.policy_error is not None, what="the load to fail")
        await pilot.pause()
        assert any(NO_DEFAULT_MODEL in n for n in notes(app))
        assert "model: none" in plain(app.query_one("#status-model"))
        await send(pilot, "hello")
        assert app.is_running and not app.running


@pytest.mark.parametrize("spec", ["replay:{script}"])
async def test_policy_spec_is_loaded_off_the_ui_thread(workspace, tmp_path, spec):
    from tui.app import ApprenticeApp
    from tui.runner import Settings
    script = tmp_path / "fix.json"
    script.write_text(json.dumps([FINISH]))
    app = ApprenticeApp(Settings(workspace=workspace, policy_spec=spec.format(script=script)))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "quick")                         # may arrive before the policy
        await wait_for(pilot, lambda: app.session_id is not None and not app.running)
        await app.workers.wait_for_complete()
        assert "replay:fix.json" in plain(app.query_one("#status-model"))
        assert SessionStore().get_session(app.session_id)["status"] == "finished"
