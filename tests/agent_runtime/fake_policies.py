"""Policies for tests that need no model."""

import json

from agent_runtime.policies.base import Completion


def finish_call(summary: str = "done") -> str:
    return ("<tool_call>\n" + json.dumps({"name": "finish", "arguments": {"summary": summary}})
            + "\n</tool_call>")


class GrammarTaker:
    """Takes a call grammar (as the engine does) and calls `finish` at once, keeping every
    grammar it was handed (None when the loop handed none)."""
    name, version, context_window = "grammar-taker", 0, 4096
    accepts_grammar = True

    def __init__(self):
        self.grammars = []

    def count_tokens(self, messages, tools=None):
        return 10

    def complete(self, messages, tools=None, *, grammar=None, **kw):
        self.grammars.append(grammar)
        return Completion(text=finish_call(), prompt_ids=[1], completion_ids=[2], logprobs=[0.0])
