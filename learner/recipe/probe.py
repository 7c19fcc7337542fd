"""Which name does a model search for first on a rename? A teacher-forced probe, seconds a model.

    python -m learner.recipe.probe --model DIR [-n 8]

For held-out `rename_symbol` tasks, the prompt the agent would send (system prompt, the task,
the tool listing of the model's harness) is followed by the start of the oracle's first turn,
up to its search pattern (`Let me find all uses.` and the `grep` call), and the probe scores
log P(old name) - log P(new name) as the next tokens: positive when the model would search
for the old name, the one the code has. It does so for the task as worded and for two
rewordings that keep its meaning: "Hi. " put before it, and (when the task opens with a
sentence before its first name) that sentence dropped. Shipped model, "We are standardising
names in pkg. `a` must become `b`": the old name loses by ~9 nats, and wins without the first
sentence (README, "Where a name stands"). Greedy episodes then follow the sign: the first
search is the one the probe prefers.

Not an evaluation (no episode runs, no tool answers): a check of one decision, cheap enough
to run on every SFT checkpoint.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

PREFIX = 'Let me find all uses.\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "'


def variants(instruction: str) -> dict[str, str]:
    """The task as worded, with "Hi. " before it, and without an opening sentence."""
    out = {"as worded": instruction, "'Hi.' before it": "Hi. " + instruction}
    first = instruction.find("`")
    head = instruction[:first]
    if first > 0 and ". " in head:
        out["first sentence dropped"] = instruction[head.rindex(". ") + 2:]
    return out


def prompt_ids(policy, instruction: str) -> list[int]:
    """The agent's first prompt for `instruction` (default system prompt and tools) followed
    by the oracle's first turn up to its search pattern (`PREFIX`), in `policy`'s tokens."""
    from agent_runtime.agent import DEFAULT_SYSTEM_PROMPT
    from agent_runtime.tools.base import tool_schema
    from agent_runtime.tools.registry import default_tools
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": instruction}]
    rendered = policy.template.render(messages, tools=[tool_schema(t) for t in default_tools()],
                                      add_generation_prompt=True)
    return policy.tokenizer.encode(rendered + PREFIX)


def name_margins(policy, tasks) -> dict[tuple[str, str], list[float]]:
    """{(wording, variant): [log P(old) - log P(new) per task]} for rename tasks `tasks`."""
    from learner.tasks.rename import PHRASES
    tok, model = policy.tokenizer, policy.model

    def logp(prefix: list[int], name: str) -> float:
        ids = tok.encode(name)
        x = torch.tensor([prefix + ids], device=next(model.parameters()).device)
        with torch.no_grad():
            lp = model(x).logits[0].float().log_softmax(-1)
        return sum(lp[len(prefix) - 1 + i, t].item() for i, t in enumerate(ids))

    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for task in tasks:
        old, new = task.meta["old"], task.meta["new"]
        wording = PHRASES[task.meta["phrase"][0]].text[:40]
        for name, text in variants(task.instruction).items():
            prefix = prompt_ids(policy, text)
            out[(wording, name)].append(logp(prefix, old) - logp(prefix, new))
    return out


def main() -> None:
    from agent_runtime.policies.engine import EnginePolicy
    from learner.tasks import generate
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("-n", type=int, default=8, help="held-out rename tasks")
    args = ap.parse_args()
    policy = EnginePolicy.load(args.model)
    policy.model.float()
    tasks = generate("heldout", args.n, families=["rename_symbol"])
    for (wording, name), m in sorted(name_margins(policy, tasks).items()):
        mean = sum(m) / len(m)
        print(f"{wording:42s} {name:24s} old first in {sum(x > 0 for x in m)} / {len(m)}, "
              f"mean log P(old) - log P(new) {mean:+.2f}")


if __name__ == "__main__":
    main()
