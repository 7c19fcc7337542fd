"""The loop guard and temperature fallback on held-out tasks: the same tasks, greedy, with
them on (the engine's defaults) and off, in one run.

A small model decoding greedily falls into loops (`in in in ...`, `orders.cli orders.cli ...`)
and spends the rest of the call's token budget on them. The guard ends such a call after 48
repeated tokens (finish reason "loop"); the fallback samples that call again at temperature
0.7, then 1.0. This prints, for each setting, held-out pass@1, invalid tool calls, generated
tokens and wall time, and the wall-time ratio (off / on) last.

    python bench/loop_guard.py                       # the shipped model, 48 held-out tasks
    python bench/loop_guard.py --model DIR -n 8 --max-steps 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {"on": {}, "off": {"loop_span": 0, "loop_fallback": ()}}


def run(setting: str, args, tasks, home: Path) -> dict:
    from agent_runtime.policies import load_policy
    from agent_runtime.policies.batching import BatchingPolicy
    from agent_runtime.store import SessionStore
    from learner.eval import evaluate
    from learner.gate import call_kinds

    engine = load_policy(args.model, temperature=0.0, max_new_tokens=args.max_new_tokens,
                         **SETTINGS[setting])
    policy = BatchingPolicy(engine)
    store = SessionStore(home / setting)
    t0 = time.monotonic()
    report = evaluate(tasks, lambda _t: policy, store, concurrency=args.concurrency,
                      max_steps=args.max_steps)
    seconds = time.monotonic() - t0
    kinds = [k for e in report.episodes for k in call_kinds(store, e.session_id)]
    calls, invalid = len(kinds), kinds.count("invalid")
    return {"setting": setting, "pass_at_1": report.pass_at_1, "solved": report.solved,
            "n": report.n, "by_family": report.to_dict()["by_family"],
            "invalid_rate": invalid / max(calls, 1), "calls": calls,
            "tokens": sum(e.tokens for e in report.episodes), "seconds": seconds}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("-n", type=int, default=48, help="held-out tasks")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from learner.eval import resolve_tasks
    tasks = resolve_tasks("sim-heldout", args.n)
    home = Path(tempfile.mkdtemp(prefix="apprentice-loop-bench-"))
    rows = []
    for setting in ("off", "on"):
        r = run(setting, args, tasks, home)
        rows.append(r)
        print(f"{setting:>3}: pass@1 {100 * r['pass_at_1']:.1f}% ({r['solved']}/{r['n']})  "
              f"invalid calls {100 * r['invalid_rate']:.1f}% of {r['calls']}  "
              f"tokens {r['tokens']:,}  {r['seconds']:.0f}s  "
              + " ".join(f"{f} {v['passed']}/{v['n']}" for f, v in r["by_family"].items()),
              flush=True)
    if args.json:
        print(json.dumps(rows))
    off, on = rows
    print(f"wall time off/on: {off['seconds'] / on['seconds']:.2f}x")


if __name__ == "__main__":
    main()
