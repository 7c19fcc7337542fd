"""MCP out: `apprentice mcp` driven by the official `mcp` SDK client over stdio."""

from __future__ import annotations

import asyncio
import json

import pytest
from plugin_support import LinePeer, apprentice_command, call, subprocess_env, write_script

from agent_runtime.store import SessionStore


def _serve(home, root, script):
    from mcp import StdioServerParameters
    command = apprentice_command()
    env = subprocess_env(home)
    return StdioServerParameters(
        command=command[0], args=command[1:] + ["mcp", "--policy", f"replay:{script}",
                                                "--workspace-root", str(root)],
        env={k: env[k] for k in ("PYTHONPATH", "APPRENTICE_HOME", "OMP_NUM_THREADS")})


async def _session(params, action):
    from mcp import Client
    async with Client(params) as client:
        return await action(client)


@pytest.fixture
def served(home, tmp_path):
    root = tmp_path / "root"
    (root / "repo").mkdir(parents=True)
    (root / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = write_script(tmp_path / "script.json", [
        call("edit_file", path="calc.py", old="a - b", new="a + b"),
        call("finish", summary="fixed add")])
    return _serve(home, root, script), root


def test_the_server_lists_run_task(served):
    params, _ = served
    tools = asyncio.run(_session(params, lambda c: c.list_tools()))
    assert [t.name for t in tools.tools] == ["run_task"]


def test_run_task_returns_summary_and_diff(served):
    params, _ = served
    result = asyncio.run(_session(params, lambda c: c.call_tool(
        "run_task", {"task": "fix add", "workspace": "repo"})))
    out = result.structured_content
    assert (out["status"], out["summary"]) == ("finished", "fixed add") and "+    return a + b" in out["diff"]


def test_run_task_changes_the_workspace(served):
    params, root = served
    asyncio.run(_session(params, lambda c: c.call_tool("run_task", {"task": "fix add",
                                                                    "workspace": "repo"})))
    assert "a + b" in (root / "repo" / "calc.py").read_text()


def test_run_task_is_an_ordinary_session_in_the_store(served, home):
    params, _ = served
    result = asyncio.run(_session(params, lambda c: c.call_tool(
        "run_task", {"task": "fix add", "workspace": "repo"})))
    with SessionStore(home) as store:
        assert store.get_session(result.structured_content["session_id"])["task"] == "fix add"


def test_a_workspace_that_opted_out_is_never_learned_from(served, home):
    params, root = served
    (root / "repo" / ".apprentice-no-learn").write_text("")
    result = asyncio.run(_session(params, lambda c: c.call_tool(
        "run_task", {"task": "fix add", "workspace": "repo"})))
    with SessionStore(home) as store:
        assert store.get_session(result.structured_content["session_id"])["learn"] is False


def test_a_workspace_outside_the_root_is_a_tool_error_and_the_server_keeps_serving(served):
    params, _ = served

    async def action(client):
        bad = await client.call_tool("run_task", {"task": "x", "workspace": "../.."})
        tools = await client.list_tools()
        return bad, tools

    bad, tools = asyncio.run(_session(params, action))
    assert bad.is_error and "outside the served root" in json.dumps(bad.model_dump(mode="json"))
    assert tools.tools


@pytest.fixture(scope="module")
def raw_answers(tmp_path_factory):
    """`apprentice mcp` on pipes: bad lines, then a handshake and a tool listing."""
    tmp = tmp_path_factory.mktemp("mcp_wire")
    script = write_script(tmp / "script.json", [call("finish", summary="done")])
    peer = LinePeer(apprentice_command() + ["mcp", "--policy", f"replay:{script}",
                                            "--workspace-root", str(tmp)],
                    subprocess_env(tmp / "home"))
    try:
        out = {"not json": peer.send("{not json"), "array": peer.send("[1, 2]")}
        out["initialize"] = peer.request(1, "initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}})
        peer.notify("notifications/initialized")
        out["unknown tool"] = peer.request(2, "tools/call", {"name": "nope", "arguments": {}})
        out["bad arguments"] = peer.request(3, "tools/call", {"name": "run_task",
                                                              "arguments": {"task": 5}})
        out["list"] = peer.request(4, "tools/list", {})
    finally:
        peer.close()
    return out


def test_malformed_json_to_the_mcp_server_is_a_parse_error(raw_answers):
    assert raw_answers["not json"]["error"]["code"] == -32700


def test_a_non_object_to_the_mcp_server_is_an_invalid_request(raw_answers):
    assert raw_answers["array"]["error"]["code"] == -32600


def test_an_unknown_tool_is_a_tool_error(raw_answers):
    assert raw_answers["unknown tool"]["result"]["isError"] is True


def test_arguments_of_the_wrong_type_are_a_tool_error(raw_answers):
    assert raw_answers["bad arguments"]["result"]["isError"] is True


def test_the_mcp_server_keeps_serving_after_bad_input(raw_answers):
    assert [t["name"] for t in raw_answers["list"]["result"]["tools"]] == ["run_task"]
