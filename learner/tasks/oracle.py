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
import re

from agent_runtime.mentions import definitions, mentions
from agent_runtime.policies.replay import ReplayPolicy

ORACLE_NAME = "oracle"


def render_turn(say: str, calls: list[dict]) -> str:
    """One assistant message: the sentence, then one `<tool_call>` block per call."""
    blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls]
    return "\n".join([say, *blocks]) if say else "\n".join(blocks)


SEARCH = re.compile(r"(?:def )?(\w+)(?:\\b)?")   # a plan's `grep` for a name (or its `def`)


def script(task, mentions: bool = False) -> list[str]:
    """The assistant turns that solve `task` (from its `solution` plan), finish included.
    With `mentions` (the task shows where its names are defined, `agent_runtime.mentions`),
    a turn that only searches for such a name, right before reading the file the task shows
    it in, is left out: the task already answered it. (A rename's search stays: it lists
    the uses, which the next call edits without reading them.)"""
    plan = task.solution
    if not isinstance(plan, dict) or "turns" not in plan:
        raise ValueError(f"task {task.id} has no oracle plan (only generated tasks, or task "
                         "folders exported with their solution, have one)")
    steps = plan["turns"]
    if mentions:
        known = looked_up(task)
        steps = [t for i, t in enumerate(steps)
                 if not _answered(t, steps[i + 1] if i + 1 < len(steps) else None, known)]
    turns = [render_turn(t.get("say", ""), t["calls"]) for t in steps]
    summary = plan.get("summary") or "Done."
    turns.append(render_turn("Done.", [{"name": "finish", "arguments": {"summary": summary}}]))
    return turns


def looked_up(task) -> dict[str, str]:
    """name -> the file the task's mention block shows its definition in."""
    files = [(p, t) for p, t in task.files.items() if isinstance(t, str)]
    return {m.name: m.where.rsplit(":", 1)[0]
            for m in mentions(task.instruction, definitions(files)) if m.where}


def _answered(turn: dict, following: dict | None, known: dict[str, str]) -> bool:
    calls = turn["calls"]
    if len(calls) != 1 or calls[0]["name"] != "grep" or following is None:
        return False
    m = SEARCH.fullmatch(calls[0]["arguments"].get("pattern", ""))
    reads = {c["arguments"].get("path") for c in following["calls"] if c["name"] == "read_file"}
    return m is not None and m.group(1) in known and known[m.group(1)] in reads


class OraclePolicy(ReplayPolicy):
    """A `Policy` that solves one generated task; build one per task: `OraclePolicy(task)`.
    With `mentions`, it is a policy trained with the task's names looked up: the agent loop
    shows it the mention block and its plan skips the searches the block answers."""

    def __init__(self, task, *, context_window: int = 32768, version: int = 0,
                 mentions: bool = False):
        super().__init__(script(task, mentions), name=ORACLE_NAME,
                         context_window=context_window, version=version)
        self.task_id = task.id
        self.mentions = mentions
