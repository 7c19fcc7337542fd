"""Approval rules, the blocking gate and the tool wrapper (no UI)."""

import json
import threading

import pytest

from agent_runtime.approvals import ALWAYS, NO, YES, ApprovalGate, ApprovalStore, GatedTool, gated
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "calc"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    return ws


EDIT = ("edit_file", {"path": "a.py", "old": "x", "new": "y"})
RUN = ("run_command", {"command": "pytest -q"})
READ = ("read_file", {"path": "a.py"})


def gate_answering(home, workspace, answer, mode="ask"):
    asked = []

    def ask(request, reply):
        asked.append(request)
        threading.Timer(0.01, reply, [answer]).start()   # the UI answers from another thread

    return ApprovalGate(ApprovalStore(home), workspace, mode, ask=ask), asked


@pytest.mark.parametrize("mode,needs", [
    ("ask", {"edit_file", "run_command"}),
    ("auto-edit", {"run_command"}),
    ("full-auto", set()),
])
def test_modes_decide_which_calls_ask(home, workspace, mode, needs):
    gate = ApprovalGate(ApprovalStore(home), workspace, mode)
    asking = {name for name, args in (EDIT, RUN, READ) if gate.request_for(name, args)}
    assert asking == needs


def test_yes_lets_the_call_run(home, workspace):
    gate, asked = gate_answering(home, workspace, YES)
    gate.check(*RUN)
    assert [r.tool for r in asked] == ["run_command"]


def test_no_raises_a_tool_error_for_the_model(home, workspace):
    gate, _ = gate_answering(home, workspace, NO)
    with pytest.raises(ToolError, match="the user declined"):
        gate.check(*EDIT)


def test_always_is_remembered_per_workspace(home, workspace, tmp_path):
    gate, asked = gate_answering(home, workspace, ALWAYS)
    gate.check(*RUN)
    gate.check(*RUN)                                       # not asked again
    assert len(asked) == 1
    assert ApprovalStore(home).rules(workspace) == {"command:pytest -q"}
    other = tmp_path / "other"
    other.mkdir()
    assert ApprovalStore(home).rules(other) == set()
    saved = json.loads((home / "approvals.json").read_text())
    assert saved == {str(workspace.resolve()): {"commands": ["pytest -q"]}}


def test_always_allowing_edits_covers_every_file(home, workspace):
    gate, asked = gate_answering(home, workspace, ALWAYS)
    gate.check(*EDIT)
    gate.check("write_file", {"path": "b.py", "content": ""})
    assert len(asked) == 1 and asked[0].rule == "edits"
    assert "edits" in ApprovalStore(home).rules(workspace)


def test_a_corrupt_file_means_no_rules(home, workspace):
    home.mkdir(parents=True)
    (home / "approvals.json").write_text("{not json")
    assert ApprovalStore(home).rules(workspace) == set()


def test_cancel_releases_a_waiting_call(home, workspace):
    gate = ApprovalGate(ApprovalStore(home), workspace, "ask", ask=lambda request, reply: None)
    threading.Timer(0.05, gate.cancel_event.set).start()
    with pytest.raises(ToolError, match="cancelled"):
        gate.check(*RUN)


def test_without_anyone_to_ask_the_call_is_refused(home, workspace):
    with pytest.raises(ToolError, match="approval"):
        ApprovalGate(ApprovalStore(home), workspace, "ask").check(*RUN)


def test_gated_tool_is_the_same_tool_behind_the_gate(home, workspace):
    class Echo:
        name, description, mutates = "run_command", "runs", True
        parameters = {"type": "object"}

        def __call__(self, args, ctx):
            return ToolResult("ran " + args["command"])

    class Reader(Echo):
        name, mutates = "read_file", False

    gate, asked = gate_answering(home, workspace, YES)
    wrapped, reader = gated([Echo(), Reader()], gate)
    assert isinstance(wrapped, GatedTool) and not isinstance(reader, GatedTool)
    assert (wrapped.name, wrapped.mutates, wrapped.parameters) == ("run_command", True,
                                                                  {"type": "object"})
    assert wrapped({"command": "ls"}, ToolContext(workspace=workspace)).text == "ran ls"
    assert len(asked) == 1


def test_unknown_mode_is_refused(home, workspace):
    with pytest.raises(ValueError, match="approval mode"):
        ApprovalGate(ApprovalStore(home), workspace, "yolo")


class External:
    """A tool with unknown effects (an MCP server's), which asks like a command."""
    name, description, mutates, needs_approval = "mcp__srv__do", "does things", True, True
    parameters = {"type": "object", "properties": {}}

    def __call__(self, args, ctx):
        return ToolResult("done")


def test_an_external_tool_asks_in_auto_edit_mode(tmp_path):
    gate = ApprovalGate(ApprovalStore(tmp_path), tmp_path, mode="auto-edit")
    assert gate.request_for("mcp__srv__do", {}, External()).rule == "tool:mcp__srv__do"


def test_always_allowing_an_external_tool_persists_by_name(tmp_path):
    gate = ApprovalGate(ApprovalStore(tmp_path), tmp_path, ask=lambda r, reply: reply(ALWAYS))
    gate.check("mcp__srv__do", {}, External())
    fresh = ApprovalGate(ApprovalStore(tmp_path), tmp_path)
    assert fresh.request_for("mcp__srv__do", {}, External()) is None


def test_gated_wraps_external_tools(tmp_path):
    gate = ApprovalGate(ApprovalStore(tmp_path), tmp_path)
    assert isinstance(gated([External()], gate)[0], GatedTool)


def test_an_answer_that_comes_with_a_cancel_is_a_cancellation(tmp_path):
    gate = ApprovalGate(ApprovalStore(tmp_path), tmp_path,
                        ask=lambda r, reply: (gate.cancel_event.set(), reply(None)))
    with pytest.raises(ToolError, match="cancelled"):
        gate.check(*RUN)


@pytest.mark.parametrize("sandbox_mode,asks", [("auto", True), ("off", False)])
def test_without_a_sandbox_commands_ask_even_in_full_auto(home, workspace, sandbox_mode, asks):
    """bubblewrap missing (a name that is not on PATH): under `auto` commands would run with
    the user's permissions and ask in every mode; `off` is the user's own opt-out."""
    from agent_runtime.sandbox import Sandbox, SandboxConfig
    from agent_runtime.tools.registry import default_tools
    sandbox = Sandbox(workspace, SandboxConfig(mode=sandbox_mode, bwrap="no-such-bwrap"))
    gate, asked = gate_answering(home, workspace, YES, mode="full-auto")
    tools = {t.name: t for t in gated(default_tools(), gate)}
    ctx = ToolContext(workspace=workspace, sandbox=sandbox)
    result = tools["run_command"]({"command": "echo hi"}, ctx)
    tools["edit_file"]({"path": "calc.py", "old": "a - b", "new": "a + b"}, ctx)
    assert "hi" in result.text and not sandbox.sandboxed
    assert [(r.tool, r.unconfined) for r in asked] == ([("run_command", True)] if asks else [])
    sandbox.close()
