"""Online RL from use, with a simulated user of fixed, rule-based taste.

Each round, the serving version runs real agent sessions (our engine, the Agent loop, the
normal tools and sandbox) on train-split simulated tasks, recorded as the user's sessions.
The simulated user rates each one through the store, as `apprentice feedback` does:

    liked      the agent ran the tests (a test command) before calling `finish`
    disliked   the agent rewrote a file that already existed with `write_file` (where
               `edit_file` would do)

(a session showing both is disliked). It rates the message it means (`--rate messages`, the
default): thumbs up on the test run that checked the final change (the first after the last
edit; runs repeating it checked nothing new) and on the `finish` after it unless a check it
ran was still failing (`learner.sentiment.finished_failing`: nobody praises "done" over a
red run, and that `finish` carries the implicit -1 instead), thumbs down on
each `write_file` that rewrote a file, and thumbs down on a `finish` that came without a test
run; a session that never finished gets no rating. (Without the thumbs up on a `finish` that
came after the tests, the only rating a `finish` could get was a thumbs down, and an update
that concentrates on the rated decisions learned to stop finishing: probe sessions ending in
`finish` 42 -> 17 of 48.) `--rate sessions` rates whole sessions instead (liked +1,
disliked -1, neither unrated): every model call of the session carries the rating, so the
one decision the taste is about is a few tokens among hundreds (measured: 8 cycles moved the
liked rate by +0.0 points). Then one learning
cycle runs exactly as the daemon runs it (`learner.online.OnlineLearner.run_cycle`: rewards,
the update on the recorded samples, the gate, publishing). Before the first and after the
last round, the same fixed sessions measure: the rate of the liked and of the disliked
behaviour, held-out pass@1, the invalid-tool-call rate and the rate of repeated calls (the
same call, the same result: `learner.gate`); and each
published update's size ratio (full bf16 state / delta) is printed. Goal (issue 13): liked
+20 points, pass@1 not lower by more than 2 points, invalid calls not higher, deltas >= 40x
smaller than the state.

    python bench/online.py                          # the shipped default model
    python bench/online.py --model DIR --rounds 4 --sessions 16 --eval-n 16
    python bench/online.py --model DIR --rounds 1 --sessions 2 --eval-n 1 --max-steps 2 \
        --max-new-tokens 16 --gate-tasks 0           # a smoke run (tiny checkpoints)

It works in a fresh temporary `$APPRENTICE_HOME` (or `--home`) and never touches yours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEST_RE = re.compile(r"(pytest|unittest|test_\w+\.py|\w+_test\.py|make test|npm test)")


def taste(task, calls: list[dict]) -> tuple[int, list[tuple[int, int]]]:
    """The simulated user's fixed rules: (+1 liked / -1 disliked / 0 neither, [(assistant
    message id, +1/-1)] the messages that decided it)."""
    from agent_runtime.approvals import EDIT_TOOLS
    from learner.sentiment import finished_failing
    rewrites = [c["message_id"] for c in calls if c["name"] == "write_file"
                and (c["arguments"] or {}).get("path") in task.files]
    if rewrites:
        return -1, [(m, -1) for m in dict.fromkeys(rewrites)]
    names = [c["name"] for c in calls]
    if "finish" not in names:
        return 0, []
    finish = names.index("finish")
    tests = [i for i, c in enumerate(calls[:finish]) if c["name"] == "run_command"
             and TEST_RE.search(str((c["arguments"] or {}).get("command", "")))]
    if tests:
        # the run that checked the final change: the first after the last edit (the runs
        # repeating it checked nothing new), else the last one
        edits = [i for i, c in enumerate(calls[:finish]) if c["name"] in EDIT_TOOLS]
        after = [i for i in tests if not edits or i > edits[-1]]
        checked = after[0] if after else tests[-1]
        thumbs = [(calls[checked]["message_id"], 1)]
        if calls[finish]["message_id"] not in finished_failing(calls[:finish + 1]):
            thumbs.append((calls[finish]["message_id"], 1))
        return 1, thumbs
    return 0, [(calls[finish]["message_id"], -1)]


def rate(store, session_id: str, rating: int, messages: list[tuple[int, int]], how: str) -> None:
    """Record the simulated user's thumbs as `apprentice feedback` does."""
    if how == "sessions":
        if rating:
            store.add_feedback(rating, session_id=session_id, comment="bench/online.py taste")
        return
    for message_id, r in messages:
        store.add_feedback(r, session_id=session_id, message_id=message_id,
                           comment="bench/online.py taste")


def sessions(policy, tasks, store, args, origin: str) -> list[tuple]:
    """Run one episode per task; [(task, session id, rating, rated messages)]."""
    from learner.rollout import run_episodes
    eps = run_episodes(lambda _t: policy, tasks, store, concurrency=args.concurrency,
                       max_steps=args.max_steps, sandbox=args.sandbox, origin=origin)
    return [(t, e.session_id, *taste(t, store.tool_calls(e.session_id)))
            for t, e in zip(tasks, eps)]


def behaviour(rated: list[tuple]) -> dict:
    n = max(1, len(rated))
    return {"liked_rate": sum(r[2] > 0 for r in rated) / n,
            "disliked_rate": sum(r[2] < 0 for r in rated) / n}


def load(args, state=None, version: int = 0):
    from agent_runtime.policies.batching import shared
    from agent_runtime.policies.engine import EnginePolicy
    engine = EnginePolicy.load(args.model, temperature=args.temperature, dtype="bfloat16",
                               max_new_tokens=args.max_new_tokens, version=version)
    if state is not None:
        engine.load_state(state, version)
    return shared(engine, args.concurrency)


def measure(args, state, version, store, gate) -> dict:
    """The fixed measurement: behaviour on `--probe` train tasks, held-out pass@1, invalid
    and repeated calls on `--eval-n` held-out tasks (greedy)."""
    from agent_runtime.names import ORIGIN_EVAL
    from learner.tasks import generate
    probe = generate("train", args.probe, seed=10_000)
    rated = sessions(load(args, state, version), probe, store, args, ORIGIN_EVAL)
    held = gate.measure(state)
    return {**behaviour(rated), "pass_at_1": held.pass_at_1, "invalid_rate": held.invalid_rate,
            "repeat_rate": held.repeat_rate}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="checkpoint (default: the shipped one)")
    p.add_argument("--rounds", type=int, default=3, help="rated rounds, one cycle each")
    p.add_argument("--sessions", type=int, default=16, help="rated sessions per round")
    p.add_argument("--probe", type=int, default=48, help="fixed sessions measuring behaviour "
                   "(at the sessions' temperature: with 16, two measurements of one model "
                   "differed by 31 points)")
    p.add_argument("--eval-n", type=int, default=40, help="held-out tasks for pass@1 (one "
                   "task of 16 is 6.25 points, coarser than the 2-point goal)")
    p.add_argument("--gate-tasks", type=int, default=None,
                   help="the gate's held-out tasks (default: the learner's)")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="per model call, in the sessions, the gate and the held-out episodes "
                        "(as `apprentice eval`; at 256 about half the rated sessions' invalid "
                        "calls were turns of several calls cut off, not broken calls)")
    p.add_argument("--temperature", type=float, default=1.0, help="sessions' sampling")
    p.add_argument("--lr", type=float, default=None, help="default: the learner's")
    p.add_argument("--max-update", type=float, default=None)
    p.add_argument("--max-changed", type=float, default=None,
                   help="share of the weights one cycle may change")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per cycle")
    p.add_argument("--negatives", choices=("all", "decision"), default=None,
                   help="the tokens of a disliked call that train (LossConfig.negatives; "
                        "default: the learner's)")
    p.add_argument("--balance", choices=("on", "off"), default=None,
                   help="the disliked side of a step weighs what the liked side does "
                        "(LossConfig.balance; default: the learner's)")
    p.add_argument("--unlikelihood", type=float, default=None,
                   help="weight of -log(1 - p) on the loop a cut-off call ran into "
                        "(LossConfig.unlikelihood; default: the learner's)")
    p.add_argument("--backtrack", type=int, default=1,
                   help="halvings of a rejected candidate, each gated again")
    p.add_argument("--practice-tasks", type=int, default=0,
                   help="simulated training tasks the serving version practises each cycle, "
                        "its passes trained on beside the ratings (`learner.practice`; 0: none)")
    p.add_argument("--rate", choices=("messages", "sessions"), default="messages",
                   help="what the simulated user rates (see the module docstring)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="rated and probe sessions decoded at once (the held-out evaluation "
                        "runs one episode at a time, as the gate does: at 4, which calls "
                        "share a batch moves its greedy numbers)")
    p.add_argument("--sandbox", default=None)
    p.add_argument("--home", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print the numbers as JSON at the end")
    args = p.parse_args(argv)

    from agent_runtime.names import ORIGIN_USER
    from agent_runtime.policies import resolve_model_path
    from agent_runtime.store import SessionStore
    from learner.gate import Gate, GateConfig
    from learner.online import OnlineConfig, OnlineLearner
    from learner.practice import PracticeConfig
    from learner.tasks import generate

    args.model = str(resolve_model_path(args.model))
    home = args.home or Path(tempfile.mkdtemp(prefix="apprentice-online-bench-"))
    os.environ["APPRENTICE_HOME"] = str(home)
    store = SessionStore(home)
    tuning = {k: v for k, v in [("steps", args.steps), ("max_update", args.max_update),
                                ("max_changed", args.max_changed)] if v is not None}
    gate_tasks = {} if args.gate_tasks is None else {"n_tasks": args.gate_tasks}
    config = OnlineConfig(model=args.model, backtrack=args.backtrack, **tuning,
                          gate=GateConfig(max_steps=args.max_steps, **gate_tasks,
                                          max_new_tokens=args.max_new_tokens,
                                          sandbox=args.sandbox),
                          practice=PracticeConfig(tasks=args.practice_tasks,
                                                  temperature=args.temperature,
                                                  max_steps=args.max_steps,
                                                  max_new_tokens=args.max_new_tokens,
                                                  concurrency=args.concurrency,
                                                  sandbox=args.sandbox))
    config.trainer.temperature = args.temperature
    if args.lr is not None:
        config.trainer.optim.lr = args.lr
    if args.negatives is not None:
        config.trainer.loss.negatives = args.negatives
    if args.unlikelihood is not None:
        config.trainer.loss.unlikelihood = args.unlikelihood
    if args.balance is not None:
        config.trainer.loss.balance = args.balance == "on"
    learner = OnlineLearner(store, config)
    evaluator = Gate(args.model, home / "bench-eval",
                     GateConfig(n_tasks=args.eval_n, seed=1, max_steps=args.max_steps,
                                max_new_tokens=args.max_new_tokens, sandbox=args.sandbox))
    version, state = learner.serving_state()
    t0 = time.monotonic()
    before = measure(args, state, version, store, evaluator)
    print(f"before (v{version}): {_row(before)}", flush=True)
    cycles = []
    for r in range(args.rounds):
        tasks = generate("train", args.sessions, seed=r)
        rated = sessions(load(args, state, version), tasks, store, args, ORIGIN_USER)
        for _, sid, rating, messages in rated:
            rate(store, sid, rating, messages, args.rate)
        result = learner.run_cycle()
        info = learner.versions.info(result.version) if result.version else None
        ratio = info.nbytes / info.delta_bytes if info and info.delta_bytes else None
        cycles.append({**result.to_json(), "round": r, **behaviour(rated),
                       "delta_ratio": ratio})
        print(f"round {r}: {behaviour(rated)} -> {result.samples} samples "
              f"({result.liked} liked, {result.disliked} disliked)"
              f"{_practised(result.practice)}, "
              f"{'v' + str(result.version) if result.version else 'rejected'}: "
              f"{result.gate.get('reason')}; delta {ratio and f'{ratio:.1f}x'}", flush=True)
        version, state = learner.serving_state()
    after = measure(args, state, version, store, evaluator)
    print(f"after  (v{version}): {_row(after)}")
    ratios = [c["delta_ratio"] for c in cycles if c["delta_ratio"]]
    se = math.hypot(_se(before["liked_rate"], args.probe), _se(after["liked_rate"], args.probe))
    print(f"liked {100 * (after['liked_rate'] - before['liked_rate']):+.1f} points "
          f"(standard error {100 * se:.1f}), disliked "
          f"{100 * (after['disliked_rate'] - before['disliked_rate']):+.1f} points, pass@1 "
          f"{100 * (after['pass_at_1'] - before['pass_at_1']):+.1f} points, invalid calls "
          f"{100 * (after['invalid_rate'] - before['invalid_rate']):+.1f} points, repeated calls "
          f"{100 * (after['repeat_rate'] - before['repeat_rate']):+.1f} points; delta ratios "
          f"{', '.join(f'{x:.1f}x' for x in ratios) or '-'}; {time.monotonic() - t0:.0f}s")
    if args.json:
        print(json.dumps({"before": before, "after": after, "cycles": cycles}))


def _se(rate: float, n: int) -> float:
    """Standard error of a rate measured on n sessions."""
    return math.sqrt(rate * (1 - rate) / max(n, 1))


def _practised(stats: dict | None) -> str:
    if not stats:
        return ""
    return (f" + {stats['samples']} practice samples ({stats['passed']} of {stats['tasks']} "
            f"tasks passed)")


def _row(m: dict) -> str:
    return (f"liked {100 * m['liked_rate']:.1f}%  disliked {100 * m['disliked_rate']:.1f}%  "
            f"held-out pass@1 {100 * m['pass_at_1']:.1f}%  invalid calls "
            f"{100 * m['invalid_rate']:.1f}%  repeated calls {100 * m['repeat_rate']:.1f}%")


if __name__ == "__main__":
    main()
