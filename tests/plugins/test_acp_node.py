"""`apprentice acp` driven by the official ACP TypeScript SDK under node (a real client).

`acp_client/drive_v1.mjs` runs `ClientSideConnection` (SDK 1.x) against `apprentice acp`,
`drive_v2.mjs` the client app API of the current SDK (2.x); each reports what it saw and each
test checks one property of a report. The node packages come from
`.ci/run` (`npm ci` in tests/plugins/acp_client); without node or them the tests skip,
except under CI (`CI=true`), where they must run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_support import HERE, apprentice_command, call, subprocess_env, write_script

from agent_runtime.store import SessionStore

CLIENT = HERE / "acp_client"


def _node() -> str:
    node = shutil.which("node")
    missing = None
    if node is None:
        missing = "node is not installed"
    elif not all((CLIENT / "node_modules" / p).is_dir()
                 for p in ("acp-sdk-1", "@agentclientprotocol/sdk")):
        missing = f"the ACP TypeScript SDK is not installed (run `npm ci` in {CLIENT})"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}; CI must run the node ACP client tests")
        pytest.skip(missing)
    return node


def _drive(scenario: str, workspace: Path, home: Path, agent_args: list[str]) -> dict:
    command = [_node(), str(CLIENT / "drive_v1.mjs"), scenario, str(workspace), "--",
               *apprentice_command(), "acp", *agent_args]
    done = subprocess.run(command, cwd=CLIENT, env=subprocess_env(home), capture_output=True,
                          text=True, timeout=300)
    report = json.loads(done.stdout or "{}")
    assert done.returncode == 0 and "error" not in report, report.get("error") or done.stderr
    return report


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    """initialize → new session → prompt (an edit asks permission, allowed) → end_turn;
    load the session; a second prompt cancelled while its command asks permission."""
    tmp = tmp_path_factory.mktemp("acp_node")
    workspace = tmp / "ws"
    workspace.mkdir()
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = write_script(tmp / "script.json", [
        "I will fix the sign.\n" + call("edit_file", path="calc.py", old="a - b", new="a + b"),
        call("finish", summary="add now adds"),
        call("run_command", command="python -m pytest -q")])
    report = _drive("edit", workspace, tmp / "home", ["--policy", f"replay:{script}"])
    return report, workspace, tmp / "home"


def _updates(report, phase, kind):
    return [u for u in report["updates"].get(phase, []) if u["sessionUpdate"] == kind]


def test_initialize_states_load_session_and_no_images(edit_run):
    caps = edit_run[0]["initialize"]["agentCapabilities"]
    assert caps["loadSession"] is True and caps["promptCapabilities"]["image"] is False


def test_new_session_offers_the_approval_modes(edit_run):
    modes = edit_run[0]["newSession"]["modes"]
    assert [m["id"] for m in modes["availableModes"]] == ["ask", "auto-edit", "full-auto"]


def test_the_prompt_streams_agent_text(edit_run):
    chunks = _updates(edit_run[0], "prompt", "agent_message_chunk")
    assert "I will fix the sign." in "".join(c["content"]["text"] for c in chunks)


def test_the_edit_is_a_tool_call_of_kind_edit(edit_run):
    starts = _updates(edit_run[0], "prompt", "tool_call")
    assert starts[0]["kind"] == "edit"


def test_the_edit_result_is_diff_content(edit_run):
    done = [u for u in _updates(edit_run[0], "prompt", "tool_call_update") if u.get("content")]
    diff = done[0]["content"][0]
    assert (diff["type"], diff["oldText"].count("a - b"), diff["newText"].count("a + b")) == ("diff", 1, 1)


def test_the_permission_request_shows_the_diff(edit_run):
    request = edit_run[0]["permissions"][0]
    assert request["toolCall"]["content"][0]["type"] == "diff"


def test_the_allowed_edit_is_written_through_the_client(edit_run):
    report, workspace, _ = edit_run
    assert report["writes"] == [str(workspace / "calc.py")] and "a + b" in (workspace / "calc.py").read_text()


def test_the_prompt_ends_with_end_turn(edit_run):
    assert edit_run[0]["prompt"]["stopReason"] == "end_turn"


def test_loading_the_session_replays_the_user_prompt(edit_run):
    users = _updates(edit_run[0], "load", "user_message_chunk")
    assert users[0]["content"]["text"] == "Fix add in calc.py"


def test_loading_the_session_replays_the_tool_calls(edit_run):
    calls = _updates(edit_run[0], "load", "tool_call")
    assert [(c["kind"], c["status"]) for c in calls] == [("edit", "completed"), ("think", "completed")]


def test_cancel_during_a_permission_request_ends_the_turn_cancelled(edit_run):
    assert edit_run[0]["cancel"]["stopReason"] == "cancelled"


def test_the_cancelled_command_did_not_run(edit_run):
    updates = _updates(edit_run[0], "cancel", "tool_call_update")
    assert updates[-1]["status"] == "failed" and "cancelled" in updates[-1]["rawOutput"]["text"]


def test_an_unknown_session_id_is_an_invalid_params_error(edit_run):
    assert edit_run[0]["unknownSession"]["error"]["code"] == -32602


def test_the_acp_session_is_an_ordinary_session_in_the_store(edit_run):
    report, _, home = edit_run
    with SessionStore(home) as store:
        assert store.get_session(report["newSession"]["sessionId"])["task"] == "Fix add in calc.py"


def test_a_small_checkpoint_answers_a_prompt(tmp_path):
    sys.path.insert(0, str(HERE.parent / "agent_runtime"))
    from tiny_checkpoints import save_tiny_agent_checkpoint
    checkpoint = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    report = _drive("model", tmp_path, tmp_path / "home",
                    ["--model", str(checkpoint), "--max-steps", "1"])
    assert report["prompt"]["stopReason"] in ("end_turn", "max_turn_requests")


@pytest.fixture(scope="module")
def v2_run(tmp_path_factory):
    """The same first turn with the current SDK line (2.x, the client app API), which checks
    every message against the protocol schema as it parses it."""
    tmp = tmp_path_factory.mktemp("acp_node_v2")
    workspace = tmp / "ws"
    workspace.mkdir()
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = write_script(tmp / "script.json", [
        call("edit_file", path="calc.py", old="a - b", new="a + b"), call("finish", summary="ok")])
    node = _node()
    command = [node, str(CLIENT / "drive_v2.mjs"), str(workspace), "--", *apprentice_command(),
               "acp", "--policy", f"replay:{script}"]
    done = subprocess.run(command, cwd=CLIENT, env=subprocess_env(tmp / "home"),
                          capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout or "{}")
    assert done.returncode == 0 and "error" not in report, report.get("error") or done.stderr
    return report, workspace


def test_the_current_sdk_completes_a_turn_with_end_turn(v2_run):
    assert v2_run[0]["prompt"]["stopReason"] == "end_turn"


def test_the_current_sdk_answers_the_permission_and_the_edit_lands(v2_run):
    report, workspace = v2_run
    assert len(report["permissions"]) == 1 and "a + b" in (workspace / "calc.py").read_text()
