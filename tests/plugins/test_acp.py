"""`apprentice acp` driven by the official Python SDK's client: permissions and modes, the
editor's buffers, feedback, MCP servers from the editor."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from plugin_support import (MCP_TEST_SERVER, RecordingClient, apprentice_command, call,
                            subprocess_env, write_script)

from agent_runtime.approvals import REJECTED_SOURCE
from agent_runtime.store import SessionStore

EDIT = call("edit_file", path="calc.py", old="a - b", new="a + b")
FINISH = call("finish", summary="done")


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    return ws


def drive(tmp_path, turns, steps, client=None, args=()):
    """Run `apprentice acp` on a replay of `turns`; `steps(conn, client)` is the scenario.
    Returns (client, whatever steps returned)."""
    from acp import PROTOCOL_VERSION, spawn_agent_process
    script = write_script(tmp_path / "script.json", turns)
    client = client or RecordingClient()
    command = apprentice_command()

    async def main():
        async with spawn_agent_process(
                client, command[0], *command[1:], "acp", "--policy", f"replay:{script}", *args,
                env=subprocess_env(tmp_path / "home"),
                transport_kwargs={"stderr": None}) as (conn, _):
            client.conn = conn
            await conn.initialize(protocol_version=PROTOCOL_VERSION,
                                  client_capabilities=client.capabilities())
            return await steps(conn, client)

    return client, asyncio.run(main())


def prompt_once(workspace, text="fix add", mode=None, mcp_servers=()):
    from acp import text_block

    async def steps(conn, client):
        session = await conn.new_session(cwd=str(workspace), mcp_servers=list(mcp_servers))
        if mode:
            await conn.set_session_mode(session_id=session.session_id, mode_id=mode)
        response = await conn.prompt(session_id=session.session_id, prompt=[text_block(text)])
        return session.session_id, response.stop_reason
    return steps


def test_a_rejected_edit_leaves_the_file(tmp_path, workspace):
    drive(tmp_path, [EDIT, FINISH], prompt_once(workspace), RecordingClient(["reject_once"]))
    assert "a - b" in (workspace / "calc.py").read_text()


def test_an_editor_session_in_an_opted_out_workspace_is_never_learned_from(tmp_path, workspace):
    (workspace / ".apprentice-no-learn").write_text("")
    _, (session_id, _) = drive(tmp_path, [EDIT, FINISH], prompt_once(workspace),
                               RecordingClient(["allow_once"]))
    with SessionStore(tmp_path / "home") as store:
        assert store.get_session(session_id)["learn"] is False


def test_a_rejection_is_recorded_as_implicit_feedback(tmp_path, workspace):
    _, (session_id, _) = drive(tmp_path, [EDIT, FINISH], prompt_once(workspace),
                               RecordingClient(["reject_once"]))
    with SessionStore(tmp_path / "home") as store:
        feedback = store.feedback(session_id)
    assert [(f["rating"], f["source"]) for f in feedback] == [(-1, REJECTED_SOURCE)]


def test_allow_always_is_remembered_for_the_workspace(tmp_path, workspace):
    second = call("edit_file", path="calc.py", old="a + b", new="b + a")
    client, _ = drive(tmp_path, [EDIT, second, FINISH], prompt_once(workspace),
                      RecordingClient(["allow_always"]))
    assert len(client.permission_requests) == 1 and "b + a" in (workspace / "calc.py").read_text()


def test_auto_edit_mode_edits_without_asking(tmp_path, workspace):
    client, _ = drive(tmp_path, [EDIT, FINISH], prompt_once(workspace, mode="auto-edit"))
    assert client.permission_requests == [] and "a + b" in (workspace / "calc.py").read_text()


def test_auto_edit_mode_still_asks_before_a_command(tmp_path, workspace):
    client, _ = drive(tmp_path, [call("run_command", command="echo hi"), FINISH],
                      prompt_once(workspace, mode="auto-edit"))
    assert [r.kind for r in client.permission_requests] == ["execute"]


def test_command_output_is_tool_call_content(tmp_path, workspace):
    client, _ = drive(tmp_path, [call("run_command", command="echo hello-acp"), FINISH],
                      prompt_once(workspace, mode="full-auto"))
    done = [u for u in client.updates if u.session_update == "tool_call_update" and u.content]
    assert "hello-acp" in done[0].content[0].content.text


def test_an_unknown_mode_is_an_invalid_params_error(tmp_path, workspace):
    from acp import RequestError
    with pytest.raises(RequestError) as error:
        drive(tmp_path, [FINISH], prompt_once(workspace, mode="yolo"))
    assert error.value.code == -32602


def test_the_agent_reads_the_editors_unsaved_buffer(tmp_path, workspace):
    buffers = {str(workspace / "calc.py"): "def add(a, b):\n    return a * b  # unsaved\n"}
    drive(tmp_path, [call("read_file", path="calc.py"), FINISH], prompt_once(workspace),
          RecordingClient(buffers=buffers))
    with SessionStore(tmp_path / "home") as store:
        session = store.list_sessions(1)[0]["id"]
        tool = [m for m in store.messages(session) if m["role"] == "tool"][0]
    assert "# unsaved" in tool["content"]


def test_edits_go_to_the_editors_buffer_not_the_disk(tmp_path, workspace):
    buffers = {str(workspace / "calc.py"): "def add(a, b):\n    return a - b\n"}
    client, _ = drive(tmp_path, [EDIT, FINISH], prompt_once(workspace, mode="auto-edit"),
                      RecordingClient(buffers=buffers))
    assert "a + b" in buffers[str(workspace / "calc.py")] and "a - b" in (workspace / "calc.py").read_text()


def test_a_path_outside_the_workspace_never_reaches_the_editor(tmp_path, workspace):
    escape = call("write_file", path="../outside.txt", content="x")
    client, _ = drive(tmp_path, [escape, FINISH], prompt_once(workspace, mode="full-auto"),
                      RecordingClient(buffers={}))
    assert client.writes == [] and not (tmp_path / "outside.txt").exists()


def test_good_rates_the_last_agent_turn(tmp_path, workspace):
    from acp import text_block

    async def steps(conn, client):
        session_id, _ = await prompt_once(workspace, mode="full-auto")(conn, client)
        await conn.prompt(session_id=session_id, prompt=[text_block("/good clean fix")])
        return session_id

    _, session_id = drive(tmp_path, [FINISH], steps)
    with SessionStore(tmp_path / "home") as store:
        rows = store.feedback(session_id)
        last = [m for m in store.messages(session_id) if m["role"] == "assistant"][-1]["id"]
    assert [(f["rating"], f["message_id"], f["comment"]) for f in rows] == [(1, last, "clean fix")]


def test_bad_takes_a_reason(tmp_path, workspace):
    from acp import text_block

    async def steps(conn, client):
        session_id, _ = await prompt_once(workspace, mode="full-auto")(conn, client)
        await conn.prompt(session_id=session_id, prompt=[text_block("/bad wrong_change")])
        return session_id

    _, session_id = drive(tmp_path, [FINISH], steps)
    with SessionStore(tmp_path / "home") as store:
        assert [(f["rating"], f["reason"]) for f in store.feedback(session_id)] == [(-1, "wrong_change")]


def test_an_editor_mcp_server_tool_is_called(tmp_path, workspace):
    from acp.schema import McpServerStdio
    server = McpServerStdio(name="ed", command=sys.executable, args=[str(MCP_TEST_SERVER)], env=[])
    client, _ = drive(tmp_path, [call("mcp__ed__echo", text="from the editor's server"), FINISH],
                      prompt_once(workspace, mode="full-auto", mcp_servers=[server]))
    done = [u for u in client.updates if u.session_update == "tool_call_update" and u.content]
    assert done[0].content[0].content.text == "from the editor's server"


def test_a_relative_cwd_is_an_invalid_params_error(tmp_path):
    from acp import RequestError
    with pytest.raises(RequestError) as error:
        drive(tmp_path, [FINISH], prompt_once(Path("relative/dir")))
    assert error.value.code == -32602
