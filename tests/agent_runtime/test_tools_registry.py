"""default_tools(): the eight built-ins, each a well-formed Tool."""

from __future__ import annotations

from agent_runtime.tools import Tool, ToolContext, default_tools, tool_schema
from agent_runtime.tools.finish import Finish

NAMES = ["read_file", "write_file", "edit_file", "list_files", "grep", "semantic_search",
         "run_command", "finish"]


def test_default_tools_are_the_eight_builtins():
    assert [t.name for t in default_tools()] == NAMES


def test_every_tool_satisfies_the_protocol_and_has_a_schema():
    for tool in default_tools():
        assert isinstance(tool, Tool)
        schema = tool_schema(tool)["function"]
        assert schema["description"] and schema["parameters"]["type"] == "object"
        assert set(schema["parameters"].get("required", [])) <= set(schema["parameters"]["properties"])


def test_only_writers_mutate():
    assert {t.name for t in default_tools() if t.mutates} == {"write_file", "edit_file", "run_command"}


def test_finish_returns_the_summary(tmp_path):
    res = Finish()({"summary": " Fixed the bug. "}, ToolContext(workspace=tmp_path))
    assert res.text == "Fixed the bug." and res.data["summary"] == "Fixed the bug."
