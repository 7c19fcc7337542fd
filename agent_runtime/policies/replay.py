"""The scripted policy: replays assistant messages from a JSON file, in order.

`--policy replay:FILE` runs the whole agent loop deterministically, for tests, demos and UIs.
The file is a JSON list. Each plain string is the text of one assistant turn (tool calls
written as `<tool_call>` blocks), consumed in order by normal turns. An object
`{"summary": "..."}` is consumed only by summary requests (when the self-summarizing context
asks for one), in order; with none left, a summary request gets a short generic summary, so a
script without summaries still survives a small context window. When the turns run out,
`complete` raises `ReplayExhausted` and the run fails.

Token counts are real: prompts are rendered with the default chat template and counted with
the byte-level tokenizer, so context budgets behave as with a model. completion_ids are the
encoded text, logprobs 0.0, routes None, version 0. Nothing here learns or samples.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from agent_runtime import names
from agent_runtime.context import SUMMARY_REQUEST
from agent_runtime.policies.base import Completion


class ReplayExhausted(RuntimeError):
    """The script has no assistant turn left."""


class ReplayPolicy:
    """A `Policy` whose answers come from a list instead of a model."""

    def __init__(self, script: list[Any], *, name: str = "replay", context_window: int = 32768,
                 delay: float = 0.0, version: int = 0):
        self.name, self.version, self.context_window = name, version, context_window
        self.delay = delay                     # seconds to sleep per call (for crash tests, demos)
        self.turns: list[str] = []
        self.summaries: list[str] = []
        for i, entry in enumerate(script):
            if isinstance(entry, str):
                self.turns.append(entry)
            elif isinstance(entry, dict) and isinstance(entry.get("summary"), str):
                self.summaries.append(entry["summary"])
            else:
                raise ValueError(f"script entry {i} must be a string or {{\"summary\": str}}, "
                                 f"got {entry!r:.80}")
        self.calls = 0                         # complete() calls so far
        from agent_runtime.model.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
        from agent_runtime.model.tokenizer import byte_level_tokenizer
        self.tokenizer = byte_level_tokenizer()
        self.template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "ReplayPolicy":
        path = Path(path)
        try:
            script = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(script, list):
            raise ValueError(f"{path}: a replay script is a JSON list, got {type(script).__name__}")
        kwargs.setdefault("name", f"replay:{path}")
        return cls(script, **kwargs)

    def encode_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.template.render(messages, tools=tools, add_generation_prompt=True)
        return self.tokenizer.encode(text, special=True)

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return len(self.encode_prompt(messages, tools))

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *,
                 max_new_tokens: int | None = None,
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Completion:
        prompt_ids = self.encode_prompt(messages, tools)
        if len(prompt_ids) > self.context_window:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context window "
                             f"of {self.context_window}")
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if messages and messages[-1].get("kind") == SUMMARY_REQUEST:
            text = self.summaries.pop(0) if self.summaries else _generic_summary(messages)
        elif self.turns:
            text = self.turns.pop(0)
        else:
            raise ReplayExhausted(f"{self.name}: the script has no assistant turn left")
        finish_reason = names.FINISH_STOP
        if should_stop is not None and should_stop():
            text, finish_reason = "", names.FINISH_CANCELLED
        ids = self.tokenizer.encode(text, special=True)
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            ids, finish_reason = ids[:max_new_tokens], names.FINISH_LENGTH
            text = self.tokenizer.decode(ids)
        if on_text is not None:
            for line in text.splitlines(keepends=True):   # stream line by line, like a model would
                on_text(line)
        return Completion(text=text, prompt_ids=prompt_ids, completion_ids=ids,
                          logprobs=[0.0] * len(ids), routes=None, finish_reason=finish_reason,
                          version=self.version)


def _generic_summary(messages: list[dict]) -> str:
    task = next((m["content"] for m in messages if m.get("kind") == names.KIND_TASK), "(unknown)")
    return (f"## Goal\n{task}\n## Done so far\n(replay script held no summary)\n"
            "## Key facts\n-\n## Next steps\nContinue with the task.")
