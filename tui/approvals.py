"""The approval modes and gate the TUI uses; they live in `agent_runtime.approvals`, shared
with the editor (ACP) server. Kept so `tui.approvals` imports go on working."""

from agent_runtime.approvals import (ALWAYS, COMMAND_TOOLS, EDIT_TOOLS, MODES, NO, YES,  # noqa: F401
                                     ApprovalGate, ApprovalStore, GatedTool, Request, gated,
                                     needs_approval)
