"""The self-summarizing context: what the policy sees, kept inside its context window.

A `Context` is a head (system prompt, task, and from the second segment on a summary of the
earlier work) followed by the current segment's turns. Budgets are counted in the policy's own
tokens (`Policy.count_tokens`). When the prompt reaches `summarize_at` of the window, the
policy itself is asked for a structured summary and the context restarts from system prompt +
task + summary (+ the latest user message verbatim); each restart is a new segment.

Messages are OpenAI-style dicts. Those the runtime adds carry a `kind` key (task, summary,
summary_request, nudge, user) that chat templates ignore and the store keeps in `meta`.
This module does not touch the store or announce anything; the agent loop does both.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_runtime import names
from agent_runtime.policies.base import Completion, Policy

SUMMARY_REQUEST = names.KIND_SUMMARY_REQUEST    # `kind` of the message that asks for a summary

DEFAULT_SUMMARY_INSTRUCTION = """\
Your context window is nearly full, so the conversation above will be replaced by your summary \
of it. Write that summary now so that you can finish the task from it alone. Use exactly these \
sections:
## Goal
## Done so far
## Key facts (exact file paths, names, commands, error messages and test results)
## Next steps
Reply with the summary only; do not call tools."""

SUMMARY_PREFIX = ("The earlier part of this session was condensed to fit the context window. "
                  "Summary of the work so far:\n\n")


@dataclass
class ContextConfig:
    summarize_at: float = 0.8                  # summarize when the prompt reaches this fraction of the window
    summary_instruction: str = DEFAULT_SUMMARY_INSTRUCTION  # the user message asking for a summary
    summary_max_tokens: int = 1024             # generation budget of a summary call (also kept free when trimming)


class ContextOverflow(RuntimeError):
    """The prompt cannot be brought under the policy's context window."""


class Context:
    """System prompt + task (+ summary) + the current segment's turns."""

    def __init__(self, system: str, task: str, *, summary: str | None = None,
                 segment: int = 0, config: ContextConfig | None = None):
        self.config = config or ContextConfig()
        self.system, self.task, self.summary, self.segment = system, task, summary, segment
        self.turns: list[dict] = []            # everything after the head, in order
        self.fresh = True                      # no turn added since the last (re)start

    @property
    def head(self) -> list[dict]:
        head = [{"role": "system", "content": self.system},
                {"role": "user", "content": self.task, "kind": names.KIND_TASK}]
        if self.summary is not None:
            head.append({"role": "user", "content": SUMMARY_PREFIX + self.summary,
                         "kind": names.KIND_SUMMARY})
        return head

    @property
    def messages(self) -> list[dict]:
        return self.head + self.turns

    def append(self, message: dict) -> None:
        self.turns.append(message)
        self.fresh = False

    def should_summarize(self, used: int, window: int) -> bool:
        """True when a prompt of `used` tokens reaches the threshold and a restart can help."""
        # just restarted: summarizing again cannot make the context any smaller
        return not self.fresh and used >= self.config.summarize_at * window

    @staticmethod
    def check_fits(used: int, policy: Policy) -> None:
        """`ContextOverflow` when a prompt of `used` tokens does not fit the window at all."""
        if used >= policy.context_window:
            raise ContextOverflow(f"the prompt needs {used} tokens but the context window of "
                                  f"{policy.name} is {policy.context_window}")

    def summary_request(self, policy: Policy) -> list[dict]:
        """The messages that ask for a summary, oldest turns elided until they fit."""
        ask = {"role": "user", "content": self.config.summary_instruction,
               "kind": SUMMARY_REQUEST}
        turns = [dict(m) for m in self.turns]
        limit = policy.context_window - self.config.summary_max_tokens
        for i in range(len(turns) + 1):
            request = self.head + turns + [ask]
            if policy.count_tokens(request, None) <= limit:
                return request
            if i < len(turns):
                n = len(turns[i].get("content") or "")
                turns[i]["content"] = f"[{n} characters elided to fit the context window]"
        raise ContextOverflow("even with every earlier turn elided, the summary request does "
                              f"not fit the context window of {policy.context_window} tokens")

    def summarize(self, policy: Policy, **complete_kw) -> tuple[list[dict], Completion, str]:
        """Ask the policy for a summary; returns (request messages, completion, summary text)."""
        from agent_runtime.toolcalls import parse_tool_calls
        request = self.summary_request(policy)
        completion = policy.complete(request, None,
                                     max_new_tokens=self.config.summary_max_tokens, **complete_kw)
        text = parse_tool_calls(completion.text).content.strip() or "(the summary was empty)"
        return request, completion, text

    def restart(self, summary: str) -> list[dict]:
        """Begin the next segment from the summary; returns the turns carried over verbatim."""
        latest_user = [m for m in self.turns if m.get("role") == "user" and m.get("kind") == names.KIND_USER]
        self.summary, self.segment = summary, self.segment + 1
        self.turns = [dict(latest_user[-1])] if latest_user else []
        self.fresh = True
        return list(self.turns)
