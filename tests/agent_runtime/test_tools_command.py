"""run_command: what the model sees, and what only the user sees."""

from __future__ import annotations

import pytest

from agent_runtime.sandbox import Sandbox, SandboxConfig
from agent_runtime.tools import ToolContext, ToolError
from agent_runtime.tools.command import RunCommand


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    return root


def _ctx(ws, tmp_path, **config):
    sb = Sandbox(ws, SandboxConfig(**config), session_dir=tmp_path / "session")
    return ToolContext(workspace=ws, session_dir=tmp_path / "session", sandbox=sb)


def test_output_and_exit_code(ws, tmp_path):
    ctx = _ctx(ws, tmp_path)
    res = RunCommand()({"command": "echo hello; exit 2"}, ctx)
    assert res.text == "hello\n[exit code: 2]"
    assert res.data["exit_code"] == 2
    ctx.sandbox.close()


def test_fallback_warning_goes_to_the_user_not_the_model(ws, tmp_path):
    ctx = _ctx(ws, tmp_path, mode="off")
    res = RunCommand()({"command": "echo hi"}, ctx)
    assert res.text == "hi\n[exit code: 0]"
    assert "WITHOUT a sandbox" in res.data["warning"] and res.data["sandboxed"] is False
    ctx.sandbox.close()


def test_timeout_is_reported(ws, tmp_path):
    ctx = _ctx(ws, tmp_path)
    res = RunCommand()({"command": "echo started; sleep 30", "timeout": 1}, ctx)
    assert res.text.startswith("started\n[timed out after 1 s")
    assert res.data["timed_out"]
    ctx.sandbox.close()


def test_truncated_output_names_the_saved_file(ws, tmp_path):
    ctx = _ctx(ws, tmp_path, output_cap=1000)
    res = RunCommand()({"command": "seq 1 100000"}, ctx)
    assert res.data["truncated"] and res.data["full_output_path"] in res.text
    assert res.text.startswith("1\n2\n") and res.text.endswith("100000\n[exit code: 0]")
    ctx.sandbox.close()


def test_sandbox_is_made_when_context_has_none(ws, tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    ctx = ToolContext(workspace=ws, session_dir=tmp_path / "session")
    res = RunCommand()({"command": "pwd"}, ctx)
    assert res.text.splitlines()[0] == str(ws.resolve())
    assert isinstance(ctx.sandbox, Sandbox)
    ctx.sandbox.close()


def test_empty_command_is_an_error(ws, tmp_path):
    with pytest.raises(ToolError):
        RunCommand()({"command": "  "}, _ctx(ws, tmp_path))
