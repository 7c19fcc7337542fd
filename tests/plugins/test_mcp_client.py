"""MCP in: a real MCP server subprocess (made with the `mcp` SDK) gives the agent tools."""

from __future__ import annotations

import json
import sys

import pytest
from plugin_support import MCP_TEST_SERVER, call

from agent_runtime.agent import Agent
from agent_runtime.approvals import NO, ApprovalGate, ApprovalStore, gated
from agent_runtime.hooks import plugin_tools
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore

pytestmark = pytest.mark.usefixtures("mcp_hub")


def _config_toml(home, tool_timeout=30, command=sys.executable):
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[mcp_servers.testsrv]\ncommand = {json.dumps(command)}\n'
        f'args = [{json.dumps(str(MCP_TEST_SERVER))}]\ntool_timeout_sec = {tool_timeout}\n')


def _mcp_json(workspace, name, command=sys.executable, args=(str(MCP_TEST_SERVER),), **extra):
    (workspace / ".mcp.json").write_text(json.dumps({"mcpServers": {name: {
        "command": command, "args": list(args), **extra}}}))


def _trust(workspace, answer="y"):
    from click.testing import CliRunner

    from agent_runtime.cli import main
    return CliRunner().invoke(main, ["trust-mcp", "-w", str(workspace)], input=answer + "\n")


def _run(home, workspace, turns, tools=None):
    with SessionStore(home) as store:
        agent = Agent(ReplayPolicy(turns), tools=tools, store=store, workspace=workspace)
        result = agent.run("use the server")
        tool_messages = [m for m in result.messages if m["role"] == "tool"]
        return agent, result, tool_messages


def test_a_config_toml_server_tool_is_called_by_the_agent(home, tmp_path):
    _config_toml(home)
    _, result, tools = _run(home, tmp_path, [call("mcp__testsrv__echo", text="hello from mcp"),
                                             call("finish", summary="done")])
    assert tools[0]["content"] == "hello from mcp"


def test_a_trusted_workspace_mcp_json_server_reaches_the_policy_tool_list(home, tmp_path):
    _mcp_json(tmp_path, "ws")
    _trust(tmp_path)
    agent, _, _ = _run(home, tmp_path, [call("finish", summary="done")])
    assert "mcp__ws__add" in [s["function"]["name"] for s in agent.schemas]


def test_an_untrusted_workspace_mcp_json_server_is_not_started(home, tmp_path):
    _mcp_json(tmp_path, "ws")
    assert not [t.name for t in plugin_tools(tmp_path) if t.name.startswith("mcp__ws")]


def test_declining_trust_keeps_the_server_stopped(home, tmp_path):
    _mcp_json(tmp_path, "ws")
    _trust(tmp_path, answer="n")
    assert not [t.name for t in plugin_tools(tmp_path) if t.name.startswith("mcp__ws")]


def test_a_changed_command_needs_trusting_again(home, tmp_path):
    from plugins.mcp_client import load_configs, untrusted
    _mcp_json(tmp_path, "ws")
    _trust(tmp_path)
    _mcp_json(tmp_path, "ws", args=[str(MCP_TEST_SERVER), "--other"])
    assert [c.name for c in untrusted(load_configs(home, tmp_path), home, tmp_path)] == ["ws"]


def test_a_read_only_mcp_tool_does_not_mutate(home, tmp_path):
    _config_toml(home)
    tools = {t.name: t for t in plugin_tools(tmp_path)}
    assert (tools["mcp__testsrv__add"].mutates, tools["mcp__testsrv__echo"].mutates) == (False, True)


def test_a_crashed_server_ends_in_a_tool_error(home, tmp_path):
    _config_toml(home)
    _, result, tools = _run(home, tmp_path, [call("mcp__testsrv__crash"),
                                             call("finish", summary="done")])
    assert "the MCP server testsrv failed" in tools[0]["content"] and result.ok


def test_a_hung_server_ends_in_a_tool_error_at_its_timeout(home, tmp_path):
    _config_toml(home, tool_timeout=1)
    _, result, tools = _run(home, tmp_path, [call("mcp__testsrv__hang"),
                                             call("finish", summary="done")])
    assert "did not answer within 1 s" in tools[0]["content"] and result.ok


def test_an_mcp_error_result_is_a_tool_error(home, tmp_path):
    _config_toml(home)
    _, _, tools = _run(home, tmp_path, [call("mcp__testsrv__fail"), call("finish", summary="d")])
    assert tools[0]["content"].startswith("mcp__testsrv__fail reported an error")


def test_a_server_that_cannot_start_gives_no_tools_and_the_agent_runs(home, tmp_path):
    _config_toml(home, command="/nonexistent/mcp-server")
    _, result, _ = _run(home, tmp_path, [call("finish", summary="done")])
    assert result.ok and not [t for t in plugin_tools(tmp_path) if t.name.startswith("mcp__")]


def test_a_server_that_hangs_at_start_gives_no_tools_and_the_agent_runs(home, tmp_path):
    _mcp_json(tmp_path, "mute", args=["-c", "import time; time.sleep(3600)"],
              startup_timeout_sec=1)
    _trust(tmp_path)
    agent, result, _ = _run(home, tmp_path, [call("finish", summary="done")])
    assert result.ok and not [n for n in agent.tools if n.startswith("mcp__mute")]


def test_a_broken_mcp_json_entry_is_skipped(home, tmp_path):
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"bad": {"args": []}}}))
    assert [t.name for t in plugin_tools(tmp_path) if t.name.startswith("mcp__")] == []


def test_mcp_tools_ask_under_the_approval_mode(home, tmp_path):
    _config_toml(home)
    asked = []
    gate = ApprovalGate(ApprovalStore(home), tmp_path, mode="auto-edit",
                        ask=lambda request, reply: (asked.append(request.tool), reply(NO)))
    _, _, tools = _run(home, tmp_path, [call("mcp__testsrv__echo", text="x"),
                                        call("finish", summary="d")],
                       tools=gated(plugin_tools(tmp_path), gate))
    assert asked == ["mcp__testsrv__echo"] and "declined" in tools[0]["content"]


def test_full_auto_runs_mcp_tools_without_asking(home, tmp_path):
    _config_toml(home)
    tool = {t.name: t for t in plugin_tools(tmp_path)}["mcp__testsrv__echo"]
    gate = ApprovalGate(ApprovalStore(home), tmp_path, mode="full-auto")
    assert gate.request_for(tool.name, {"text": "x"}, tool) is None
