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
import random
import re

from agent_runtime import names
from agent_runtime.policies.base import Completion, remembers
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


# -- slips: one call of the plan played with a mistake, then the turn that recovers --------

RECOVER_SAY = {
    "edit_file": ["That text was not exact; copying `old` from the file this time.",
                  "The edit did not match. Copying the exact lines the error shows.",
                  "`old` must match the file exactly; trying again with the right text."],
    "read_file": ["Wrong path. Reading the right file.",
                  "That file does not exist; the path is a different one.",
                  "I mistyped the path; reading it again."],
}


def garble(text: str, rng: random.Random) -> str:
    """`text` with one letter dropped or doubled (a copying mistake), or "" when it has none."""
    spots = [i for i, ch in enumerate(text) if ch.isalpha()]
    if not spots:
        return ""
    i = rng.choice(spots)
    return text[:i] + text[i + 1:] if rng.random() < 0.5 else text[:i] + text[i] + text[i:]


def with_slip(turns: list[str], rng: random.Random, files: dict | None = None,
              task_text: str = "") -> tuple[list[str], set[str]]:
    """The oracle's turns with one slip inserted: before a turn that edits or reads a file, a
    turn making only that call with its `old` text or path garbled (the tool then answers with
    an error: `old` not found and the closest text, or no such file), and the turn itself
    opening with a sentence that recovers. Teaches reading the error and copying again; the
    slip turn is returned in the set so the data does not train on it. Unchanged turns and an
    empty set when no turn qualifies.

    Given the task's starting `files` (and its text), a `grep` can slip too: it searches for a
    name the task gives that nothing in the code has yet (a rename's new name), else for the
    pattern with a letter dropped or doubled, gets "[no matches ...]", and the recovery says so
    and searches for the plan's pattern: a search that finds nothing is a reason to search
    for the other name, not to guess (r13 searched for the new name on a held-out rename
    wording and then edited test files until its steps ran out)."""
    from agent_runtime.toolcalls import parse_tool_calls
    fields = {"edit_file": "old", "read_file": "path"}
    if files is not None:
        fields["grep"] = "pattern"
    spots = []
    for i, text in enumerate(turns):
        for call in parse_tool_calls(text).calls:
            field = fields.get(call.name)
            if field and len(str((call.arguments or {}).get(field, ""))) >= 6:
                spots.append((i, call, field))
    if not spots:
        return turns, set()
    i, call, field = rng.choice(spots)
    args = dict(call.arguments)
    if field == "pattern":
        wrong, recover = _grep_slip(str(args[field]), files, task_text, rng)
        if not wrong:
            return turns, set()
        args[field] = wrong
    else:
        head, _, base = args[field].rpartition("/") if field == "path" else ("", "", args[field])
        garbled = garble(base, rng)
        if not garbled:
            return turns, set()
        args[field] = f"{head}/{garbled}" if head else garbled
        recover = rng.choice(RECOVER_SAY[call.name])
    say = turns[i].split("<tool_call>", 1)[0].strip()
    slip = render_turn(say, [{"name": call.name, "arguments": args}])
    fixed = recover + "\n" + turns[i][len(say):].lstrip("\n")
    return turns[:i] + [slip, fixed] + turns[i + 1:], {slip}


GREP_RECOVER_SAY = {
    "absent": ["No matches: nothing is called `{wrong}` yet. Searching for `{right}`.",
               "`{wrong}` is not in the code yet; the name to search for is `{right}`.",
               "Nothing uses `{wrong}` so far. Looking for `{right}` instead."],
    "typo": ["No matches: I mistyped the name. Searching for `{right}`.",
             "That pattern has a typo; searching for `{right}` again.",
             "Nothing matched my misspelt pattern. Searching for `{right}`."],
}


def _grep_slip(right: str, files: dict, task_text: str, rng: random.Random
               ) -> tuple[str, str]:
    """`with_slip` on a `grep` for `right`: the pattern that finds nothing in `files` and the
    sentence that recovers, or ("", "") when the drawn pattern would find something."""
    texts = [t for t in files.values() if isinstance(t, str)]
    absent = [n for n in dict.fromkeys(re.findall(r"`([A-Za-z_]\w{2,})`", task_text))
              if n != right and not any(n in t for t in texts)]
    kind = "absent" if absent and rng.random() < 0.7 else "typo"
    wrong = rng.choice(absent) if kind == "absent" else garble(right, rng)
    if not wrong or any(wrong in t for t in texts):
        return "", ""
    return wrong, rng.choice(GREP_RECOVER_SAY[kind]).format(wrong=wrong, right=right)


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


def start_turns(task, share: float, rng: random.Random) -> int:
    """How many of the oracle's turns a group of `task` starts after: 0 (the model plays the
    whole episode) with probability 1 - `share`, else uniform over 1 .. n - 3, where n is the
    number of turns of the oracle's script, finish included. Every family's plan ends with
    its change (the edit, the rename's `sed`), a check and `finish`, so the model always
    plays the change: a start after it would pass whatever the model did. A plan of fewer
    than four turns, or a task without one, always starts at 0."""
    if share <= 0 or rng.random() >= share:
        return 0
    try:
        n = len(script(task))
    except ValueError:
        return 0
    return rng.randint(1, n - 3) if n >= 4 else 0


def slip_start(task, share: float, rng: random.Random) -> tuple[list[str] | None, int]:
    """Where a group of `task` starts after a slip: with probability `share`, the oracle's
    turns with one slip (`with_slip`, searches included: a rename's search for its new name,
    which nothing in the code has yet, gets "[no matches ...]") and the number of them played
    before the policy's turn, the slip last; else (None, 0), as for a task without a plan or
    a slip. The policy then plays the recovery: what a held-out wording leaves a small model
    to do after its first call copied the wrong name (it searched for the new name, found
    nothing and finished: RUNS.md, "Runs after `r13`"), which no oracle episode shows."""
    if share <= 0 or rng.random() >= share:
        return None, 0
    try:
        turns = script(task)
    except ValueError:
        return None, 0
    slipped, slips = with_slip(turns, rng, task.files, task.instruction)
    if not slips:
        return None, 0
    return slipped, slipped.index(next(iter(slips))) + 1


def untrained(c: Completion, version: int) -> Completion:
    """The oracle's turn `c` with no token ids: the store records it as a sample with an empty
    completion, which training skips (`OracleStart`'s turns, a slip-started guide's first)."""
    return Completion(text=c.text, prompt_ids=[], completion_ids=[], logprobs=[],
                      finish_reason=c.finish_reason, version=version, meta={"oracle": True})


class OracleStart:
    """A `Policy` whose first `turns` calls are the oracle's, and the rest `policy`'s: an
    episode that starts from a state on the way to the solution (a reverse curriculum:
    Salimans & Chen 2018, "Learning Montezuma's Revenge from a Single Demonstration"; Xi et
    al. 2024, R^3, for language models). On a small policy most groups of a whole episode
    come back all failed, and a failure's advantage is spread over every call of a ten-call
    episode; started near the end, the same decision (the edit, the check, the rename's
    command) is taken in a two- or three-call episode whose outcome it decides.

    The oracle's calls come back with no token ids (its text is the loop's as any turn is),
    so the store records them as samples with an empty completion, which training skips:
    only the policy's own calls train, each with the oracle's turns before it as context.
    Everything else (window, token counts, the call grammar, `remember` for the policy's own
    calls) is the policy's. `plan` (default: the oracle's script) is the turns to play from,
    e.g. `slip_start`'s, whose last played turn is a slip."""

    def __init__(self, task, policy, turns: int, plan: list[str] | None = None):
        self.policy, self.turns = policy, turns
        self.oracle = OraclePolicy(task)
        if plan is not None:
            self.oracle.turns = list(plan)
        self.calls = 0

    def __getattr__(self, name: str):            # name, version, context_window, mentions ...
        return getattr(self.policy, name)

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return self.policy.count_tokens(messages, tools)

    def complete(self, messages: list[dict], tools: list[dict] | None = None, **kwargs):
        if bool(messages) and messages[-1].get("kind") == names.KIND_SUMMARY_REQUEST:
            return self.policy.complete(messages, tools, **kwargs)
        self.calls += 1
        if self.calls > self.turns:
            return self.policy.complete(messages, tools, **kwargs)
        c = self.oracle.complete(messages, tools, max_new_tokens=kwargs.get("max_new_tokens"),
                                 on_text=kwargs.get("on_text"),
                                 should_stop=kwargs.get("should_stop"))
        return untrained(c, self.policy.version)

    def remember(self, message: dict, completion) -> None:
        if not completion.meta.get("oracle") and remembers(self.policy):
            self.policy.remember(message, completion)


class GuidePolicy(OraclePolicy):
    """The oracle's whole episode as `policy` would have written it: each prompt rendered by
    `policy` (its tokenizer and chat template), each turn the oracle's text encoded by
    `policy`'s tokenizer and ended with its end-of-turn token, the version `policy`'s. A GRPO
    group of a task the policy never solves gets this episode as one more member
    (`RolloutConfig.guide`; LUFFY, Yan et al. 2025: off-policy guidance inside the group), so
    the group has a pass to rank its failures against. Its logprobs are zeros: no policy
    sampled these tokens, and training takes the trainer's own instead (`TrainSample.
    off_policy`). With `plan` (`slip_start`'s turns) it plays those, and its first `played`
    turns come back with no token ids, as `OracleStart`'s do: the group's members started
    after them, so the guide trains on what they had to write (the recovery), not the slip."""

    def __init__(self, task, policy, plan: list[str] | None = None, played: int = 0):
        super().__init__(task, context_window=policy.context_window, version=policy.version,
                         mentions=bool(getattr(policy, "mentions", False)))
        if plan is not None:
            self.turns = list(plan)
        self.played = played
        self.policy = policy
        self.tokenizer = policy.tokenizer
        end = policy.end_of_turn_id         # as `render` and `tokenizer`: the policy's own
        self.end = [] if end is None else [end]

    def encode_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return list(self.policy.render(messages, tools))

    def complete(self, messages: list[dict], tools: list[dict] | None = None, **kwargs):
        c = super().complete(messages, tools, **kwargs)
        if c.finish_reason != names.FINISH_STOP:
            return c
        if self.played > 0:
            self.played -= 1
            return untrained(c, self.policy.version)
        ids = list(c.completion_ids) + self.end
        return Completion(text=c.text, prompt_ids=c.prompt_ids, completion_ids=ids,
                          logprobs=[0.0] * len(ids), finish_reason=c.finish_reason,
                          version=self.policy.version)
