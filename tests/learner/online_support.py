"""Shared pieces of the online-learning tests: user sessions whose samples are given texts,
scored by the serving model exactly as the runtime records what it generates (prompt and
completion token ids, behaviour logprobs at temperature 1, the routes of every token fed)."""

from __future__ import annotations

import json
import time

import torch

from agent_runtime.agent import DEFAULT_SYSTEM_PROMPT
from agent_runtime.tools.base import tool_schema
from agent_runtime.tools.registry import default_tools

SYSTEM = DEFAULT_SYSTEM_PROMPT
# a call that does not parse: what a policy hacking its way past negative ratings emits
INVALID = "<tool_call>\n{\"name\": \"edit_file\", \"arguments\": {\n</tool_call>"
VALID = ("<tool_call>\n" + json.dumps({"name": "read_file", "arguments": {"path": "calc.py"}})
         + "\n</tool_call>")


@torch.no_grad()
def scored(policy, messages: list[dict], text: str, stop: bool = True) -> dict:
    """The sample the runtime would record had `policy` generated `text` after `messages`
    (then its end-of-turn token, or with `stop=False`, cut off at the length limit)."""
    prompt = policy.render(messages, [tool_schema(t) for t in default_tools()])
    completion = policy.tokenizer.encode(text) + ([policy.stop_token_ids[0]] if stop else [])
    ids = torch.tensor([prompt + completion[:-1]])
    out = policy.model(ids)
    logits = out.logits[0, len(prompt) - 1:].float()                  # [T, V]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return {"prompt_ids": prompt, "completion_ids": completion, "logprobs": lp.tolist(),
            "routes": out.routes[0].numpy().astype("uint8")}


def record_session(store, policy, task: str, text: str, workspace: str = "ws",
                   version: int = 1, stop: bool = True, all_forced: bool = False,
                   **session) -> str:
    """A finished user session with one model call that produced `text` (`all_forced`:
    every token of it drawn by the call grammar, not the model)."""
    sid = store.create_session(task, workspace, policy.name, version, **session)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for m in messages:
        store.add_message(sid, 0, m["role"], m["content"])
    mid = store.add_message(sid, 0, "assistant", text)
    s = scored(policy, messages, text, stop)
    store.add_sample(sid, 0, mid, s["prompt_ids"], s["completion_ids"], s["logprobs"],
                     s["routes"], version, "stop" if stop else "length",
                     forced=range(len(s["completion_ids"])) if all_forced else None)
    store.set_status(sid, "finished")
    return sid


def teach(ckpt, policy, prompts: list[list[dict]], text: str | list[str], steps: int = 60,
          lr: float = 3e-3) -> None:
    """Fine-tune the checkpoint at `ckpt` in place (cross-entropy on the completion) until it
    answers each of `prompts` with `text` (or with its own of a list of texts): a base model
    that already makes tool calls."""
    from agent_runtime.model import load_model
    from agent_runtime.model.checkpoint import save_model
    torch.manual_seed(0)
    model = load_model(ckpt, dtype=torch.float32).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    texts = [text] * len(prompts) if isinstance(text, str) else text
    rows = [scored(policy, m, t) for m, t in zip(prompts, texts, strict=True)]
    for _ in range(steps):
        opt.zero_grad()
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"][:-1]])
            logits = model(ids).logits[0, len(r["prompt_ids"]) - 1:].float()
            torch.nn.functional.cross_entropy(logits, torch.tensor(r["completion_ids"])).backward()
        opt.step()
    save_model(model.eval(), ckpt)


def wait_for(predicate, timeout: float = 180.0, interval: float = 0.1) -> None:
    """Poll `predicate` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)
