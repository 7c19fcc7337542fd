"""The oracle: a scripted policy that solves a generated task through the normal tools.

`OraclePolicy(task)` plays the plan its family wrote into `task.solution`: a few turns of
reading (`read_file`, `grep`, `run_command` to reproduce), editing (`edit_file`,
`write_file`), checking (`run_command` with the tests or the failing command) and `finish`,
each turn a short sentence and its `<tool_call>` blocks, exactly as a model would write them.
It proves every family solvable and its sessions are supervised warm-up data. It is a
`ReplayPolicy` underneath, so token counts, the chat template and the store see a normal
policy. It does not look at tool results: a plan that fails shows up in the grade.
"""

from __future__ import annotations

import json

from agent_runtime.policies.replay import ReplayPolicy

ORACLE_NAME = "oracle"


def render_turn(say: str, calls: list[dict]) -> str:
    """One assistant message: the sentence, then one `<tool_call>` block per call."""
    blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls]
    return "\n".join([say, *blocks]) if say else "\n".join(blocks)


def script(task) -> list[str]:
    """The assistant turns that solve `task` (from its `solution` plan), finish included.

    A task that shows where its names are defined (`agent_runtime.mentions`) gets the same
    plan, its searches included. `r17` was trained with the searches the block answers left
    out (a fix_bug plan went from the task straight to reading the module the block names):
    it scored 0 / 34 fix_bug held-out tasks against the shipped model's 6, its first call
    reading `tests/test_<module>.py` instead, so a search is one call the model keeps."""
    plan = task.solution
    if not isinstance(plan, dict) or "turns" not in plan:
        raise ValueError(f"task {task.id} has no oracle plan (only generated tasks, or task "
                         "folders exported with their solution, have one)")
    turns = [render_turn(t.get("say", ""), t["calls"]) for t in plan["turns"]]
    summary = plan.get("summary") or "Done."
    turns.append(render_turn("Done.", [{"name": "finish", "arguments": {"summary": summary}}]))
    return turns


class OraclePolicy(ReplayPolicy):
    """A `Policy` that solves one generated task; build one per task: `OraclePolicy(task)`.
    With `mentions`, it is a policy trained with the task's names looked up: the agent loop
    shows it the mention block."""

    def __init__(self, task, *, context_window: int = 32768, version: int = 0,
                 mentions: bool = False):
        super().__init__(script(task), name=ORACLE_NAME,
                         context_window=context_window, version=version)
        self.task_id = task.id
        self.mentions = mentions
