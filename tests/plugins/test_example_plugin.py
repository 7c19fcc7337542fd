"""The example plugin (plugins/example), installed by its entry point, gives the agent a tool;
and the hooks around it: built-ins first, the workspace passed, feedback sources collected."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plugin_support import REPO, apprentice_command, call, subprocess_env, write_script

EXAMPLE = REPO / "plugins" / "example"


@pytest.fixture
def installed(tmp_path):
    """The example installed as pip would: its module on the path and a dist-info folder
    whose entry_points.txt names it in the `apprentice` group."""
    site = tmp_path / "site"
    info = site / "apprentice_line_count-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: apprentice-line-count\n"
                                   "Version: 0.1.0\n")
    (info / "entry_points.txt").write_text("[apprentice]\nline_count = apprentice_line_count\n")
    env = subprocess_env(tmp_path / "home")
    env["PYTHONPATH"] += f":{site}:{EXAMPLE}"
    return env


def test_the_agent_calls_the_example_plugins_tool(tmp_path, installed):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "a.py").write_text("x = 1\ny = 2\n")
    script = write_script(tmp_path / "s.json", [call("line_count"), call("finish", summary="ok")])
    done = subprocess.run(apprentice_command() + ["run", "count", "-w", str(workspace),
                                                  "--policy", f"replay:{script}", "--json"],
                          env=installed, capture_output=True, text=True, timeout=120)
    ends = [json.loads(line) for line in done.stdout.splitlines() if '"tool_end"' in line]
    assert (ends[0]["name"], ends[0]["ok"], ends[0]["result"]) == ("line_count", True, ".py\t2")


def _listed_tools(env) -> list[str]:
    code = ("from agent_runtime.hooks import plugin_tools; "
            "print(' '.join(t.name for t in plugin_tools('.')))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout.split()


def test_without_its_entry_point_the_tool_is_absent(tmp_path):
    assert "line_count" not in _listed_tools(subprocess_env(tmp_path / "home"))


def test_the_built_in_tools_come_first(tmp_path, installed):
    assert _listed_tools(installed)[:8] == ["read_file", "write_file", "edit_file", "list_files",
                                            "grep", "semantic_search", "run_command", "finish"]


def test_register_tools_receives_the_resolved_workspace(tmp_path, monkeypatch):
    from agent_runtime import hooks
    seen = []

    class Probe:
        @hooks.hookimpl
        def register_tools(self, register, workspace):
            seen.append(workspace)

    probe = Probe()
    hooks.plugin_manager().register(probe)
    try:
        hooks.plugin_tools(tmp_path / "ws" / "..")
    finally:
        hooks.plugin_manager().unregister(probe)
    assert seen == [tmp_path.resolve()]


def test_feedback_sources_include_the_approval_rejection(tmp_path):
    from agent_runtime.approvals import REJECTED_SOURCE
    from agent_runtime.hooks import feedback_sources
    assert REJECTED_SOURCE in feedback_sources()
