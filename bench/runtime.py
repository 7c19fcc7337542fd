"""The agent runtime's own overhead per tool step, model time excluded, and its store writes.

Runs the real loop (parser, checks, context budget, tools, SQLite store) with the replay
policy on a scratch workspace, timing where the time goes: model calls (`complete`, the
replay policy's near-zero), prompt token counting (render + encode, done for every step's
budget check), tool execution, store writes (each its own committed transaction, with
samples of realistic size), and the rest of the loop. Not a test; run it by hand:

    python bench/runtime.py [--steps 200] [--window 32768] [--prompt 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.policies import Completion
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.store import SessionStore
from agent_runtime.tools.registry import default_tools

STORE_WRITES = ("add_message", "add_tool_call", "finish_tool_call", "add_sample", "add_segment",
                "set_status", "create_session")


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Timed:
    """Accumulates wall time per label."""

    def __init__(self):
        self.seconds, self.count = defaultdict(float), defaultdict(int)

    def wrap(self, obj, name, label=None):
        fn, label = getattr(obj, name), label or name

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.count[label] += 1
        setattr(obj, name, timed)


class SizedReplay(ReplayPolicy):
    """The replay policy with engine-sized samples (prompt ids, routes) for the store."""

    def __init__(self, script, prompt_tokens, layers, top_k, **kw):
        super().__init__(script, **kw)
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(0, 150_000, prompt_tokens).tolist()
        self.layers, self.top_k, self.rng = layers, top_k, rng

    def complete(self, messages, tools=None, **kw) -> Completion:
        out = super().complete(messages, tools, **kw)
        out.prompt_ids = self.prompt
        out.routes = self.rng.integers(0, 128, (len(out.completion_ids), self.layers, self.top_k),
                                       dtype=np.uint8)
        return out


def script(steps: int) -> list:
    turns = []
    for i in range(steps - 1):
        turns.append([call("read_file", path=f"src/m{i % 20}.py"),
                      call("list_files", path="src"),
                      call("grep", pattern=f"def f{i % 20}"),
                      call("edit_file", path=f"src/m{i % 20}.py", old=f"return {i // 20}",
                           new=f"return {i // 20 + 1}")][i % 4])
    return turns + [call("finish", summary="done")] + [{"summary": "## Goal\nbench"}] * steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="model calls (tool steps) to run")
    ap.add_argument("--window", type=int, default=32768, help="context window (tokens)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt ids stored per sample")
    ap.add_argument("--layers", type=int, default=24, help="MoE layers in stored routes")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token in stored routes")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws" / "src"
        ws.mkdir(parents=True)
        for i in range(20):
            (ws / f"m{i}.py").write_text("".join(f"def f{i}_{j}():\n    return {j}\n"
                                                 for j in range(40)) + f"def f{i}():\n    return 0\n")
        timed = Timed()
        policy = SizedReplay(script(args.steps), args.prompt, args.layers, args.top_k,
                             context_window=args.window)
        timed.wrap(policy, "complete", "model (complete)")
        timed.wrap(policy, "count_tokens", "token counting")
        with SessionStore(Path(tmp) / "home") as store:
            for name in STORE_WRITES:
                timed.wrap(store, name, "store writes")
            tool_s = []
            agent = Agent(policy, default_tools(), store, ws.parent,
                          config=AgentConfig(max_steps=args.steps + 1))
            agent.callbacks.on_tool_end = lambda c, o: tool_s.append(o.duration_s)
            start = time.perf_counter()
            result = agent.run("benchmark")
            total = time.perf_counter() - start
            writes = timed.count["store writes"]
            segments = len(store.segments(result.session_id))

    steps = result.steps
    model, count = timed.seconds["model (complete)"], timed.seconds["token counting"]
    store_s, tools = timed.seconds["store writes"], sum(tool_s)
    loop = total - model - count - store_s - tools
    print(f"{steps} steps ({result.status}), {len(tool_s)} tool calls, {segments} segments, "
          f"{total:.2f} s in all")
    print(f"per step, model time excluded: {(total - model) / steps * 1e3:.2f} ms")
    for label, seconds in [("token counting (render+encode)", count), ("tool execution", tools),
                           ("store writes", store_s), ("loop itself (parse, check, context)", loop)]:
        print(f"  {label:<38} {seconds / steps * 1e3:7.2f} ms/step")
    print(f"store: {writes} committed writes, {writes / store_s:,.0f} writes/s, "
          f"{store_s / writes * 1e3:.2f} ms each (median tool call "
          f"{statistics.median(tool_s) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
