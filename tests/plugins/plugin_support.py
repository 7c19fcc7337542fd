"""Helpers for the plugin tests: replay scripts, the MCP test server, subprocess environments."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
MCP_TEST_SERVER = HERE / "mcp_test_server.py"


def call(name: str, **arguments) -> str:
    """One assistant turn that calls `name` (the Hermes `<tool_call>` convention)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def write_script(path: Path, turns: list[str]) -> Path:
    path.write_text(json.dumps(turns), encoding="utf-8")
    return path


def subprocess_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for an `apprentice` subprocess: this checkout first on the path."""
    env = dict(os.environ, APPRENTICE_HOME=str(home), OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def apprentice_command() -> list[str]:
    return [sys.executable, "-m", "agent_runtime.cli"]
