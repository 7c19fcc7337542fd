"""A GRPO training step on real agent episodes: the calls of one conversation sharing a row of
the training forward (the trainer's default) against one row per call, in one run; with
`--compare kernels`, the training kernels in C++ (`model.TRAIN_KERNELS`: RMSNorm, the rotary
embedding and the loss's log-probabilities) against the PyTorch operations they replace; with
`--compare prefixes`, GRPO groups (G episodes of one training task each, at the stage's
temperature 0.6) with the rows that start alike fed once as a packed prefix tree (the
trainer's default, `share_prefixes`) against every row fed apart.

An agent episode is a conversation of many model calls, and each call's prompt is the whole
conversation so far: fed one row per call, the trainer runs the system prompt and every tool
result again for every later call. Sharing a row feeds the last call's tokens once and scores
every call's completion at its own positions (`learner.trainer._rows`). This rolls out a group
of the default model's episodes on held-out tasks at temperature 1 (recorded with routes, as
the GRPO pipeline records them), gives them alternating advantages, then times
`Trainer.step` on them with `share_rows` on and off, interleaved, from the same weights each
time. It prints the tokens each way feeds, the step times, the largest difference of the
training logprobs between the two ways (router replay on), and the speed-up (off / on) last.

    python bench/train_step.py                        # the shipped model, 8 episodes, 3 rounds
    python bench/train_step.py --model DIR -n 4 --max-steps 4 --rounds 2
    python bench/train_step.py --compare kernels      # C++ kernels against PyTorch's operations
    python bench/train_step.py --compare prefixes -n 8 --groups 2   # a GRPO step's 2 groups of 8
    python bench/train_step.py --compare prefixes --store RUN/grpo/run0/home --skip 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def played(args, home: Path, tasks: list[list], temperature: float) -> list:
    """Samples of each list of tasks played as one group by the model at `temperature`
    (recorded with routes, as the GRPO pipeline records them), each episode with an
    advantage of +1 or -1."""
    from agent_runtime.policies import load_policy
    from agent_runtime.policies.batching import BatchingPolicy
    from agent_runtime.store import SessionStore
    from learner.eval import evaluate
    from learner.grpo import Episode, Group, group_samples

    engine = load_policy(args.model, temperature=temperature,
                         max_new_tokens=args.max_new_tokens)
    policy = BatchingPolicy(engine)
    store = SessionStore(home)
    samples = []
    for group in tasks:
        report = evaluate(group, lambda _t: policy, store, concurrency=len(group),
                          max_steps=args.max_steps)
        eps = [Episode(e.session_id, reward=float(i % 2)) for i, e in enumerate(report.episodes)]
        samples += group_samples(Group("bench", eps, [store.samples(e.session_id) for e in eps]))
    return samples


def episodes(args, home: Path) -> list:
    """Samples of `args.n` held-out episodes at temperature 1, one task each."""
    from learner.eval import resolve_tasks
    return played(args, home, [resolve_tasks("sim-heldout", args.n)], 1.0)


def groups(args, home: Path) -> list:
    """Samples of `args.groups` GRPO groups: `args.n` episodes of each of as many training
    tasks, at the stage's temperature 0.6."""
    from learner.eval import resolve_tasks
    return played(args, home, [[t] * args.n for t in resolve_tasks("sim-train", args.groups)],
                  0.6)


def recorded_groups(args, _home: Path) -> list:
    """Samples of the first `args.groups` groups of `args.n` episodes with unequal rewards in a
    GRPO run's store (`args.store`: a stage's `run0/home`), with their recorded rewards."""
    import collections

    from agent_runtime.store import SessionStore
    from learner.grpo import Episode, Group, group_samples

    store = SessionStore(args.store)
    by_group = collections.defaultdict(list)          # a group: one task, one policy version
    for sid, task, reward, version in store.db.execute(
            "SELECT r.session_id, r.task_id, r.reward, s.policy_version FROM rewards r "
            "JOIN sessions s ON s.id = r.session_id ORDER BY s.created_at").fetchall():
        by_group[(task, version)].append(Episode(sid, reward))
    picked = [eps for eps in by_group.values()
              if len(eps) == args.n and len({e.reward for e in eps}) > 1][args.skip:]
    samples = []
    for eps in picked[:args.groups]:
        samples += group_samples(Group("recorded", eps, [store.samples(e.session_id)
                                                         for e in eps]))
    return samples


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("-n", type=int, default=8, help="episodes (held-out tasks)")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", choices=("rows", "kernels", "prefixes"), default="rows",
                   help="rows: one row per call against shared rows; kernels: PyTorch's "
                        "operations against the C++ training kernels (shared rows both ways); "
                        "prefixes: rows fed apart against a packed prefix tree (GRPO groups)")
    p.add_argument("--groups", type=int, default=2,
                   help="--compare prefixes: GRPO groups of -n episodes in the step")
    p.add_argument("--store", help="--compare prefixes: take the groups from a GRPO run's "
                                   "store (its run0/home) instead of rolling them out")
    p.add_argument("--skip", type=int, default=0, help="--store: groups to pass over first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from agent_runtime.model import load_model
    from agent_runtime.model import model as mm
    from agent_runtime.policies.base import resolve_model_path
    from learner.config import OptimConfig, TrainerConfig
    from learner.trainer import Trainer, _fed_len, _rows, _tree

    if args.threads:
        torch.set_num_threads(args.threads)
    home = Path(tempfile.mkdtemp(prefix="apprentice-train-bench-"))
    prefixes = args.compare == "prefixes"
    make = (recorded_groups if args.store else groups) if prefixes else episodes
    samples = make(args, home / "store")
    fed = {"off": sum(map(_fed_len, samples)),
           "on": sum(_fed_len(samples[row[-1]]) for row in _rows(samples))}
    feeds = [samples[r[-1]].prompt_ids + samples[r[-1]].completion_ids[:-1]
             for r in _rows(samples)]
    packed = _tree([np.asarray(f)[:, None] for f in feeds])[1]
    print(f"{len(samples)} samples of {args.n * (args.groups if prefixes else 1)} episodes, "
          f"{sum(s.n_tokens for s in samples):,} completion tokens; fed per step: one row per "
          f"call {fed['off']:,} tokens, shared rows {fed['on']:,}, a packed prefix tree "
          f"{packed:,}", flush=True)
    path = resolve_model_path(args.model)
    start = load_model(path, dtype=torch.float32).state_dict()
    rows = args.compare == "rows"
    names = {"off": "one row per call", "on": "shared rows"} if rows else \
        {"off": "rows fed apart", "on": "a packed prefix tree"} if prefixes else \
        {"off": "PyTorch's operations", "on": "C++ kernels"}
    trainers = {}
    for side in ("off", "on"):
        config = TrainerConfig(optim=OptimConfig(lr=1e-6), share_rows=side == "on" or not rows,
                               share_prefixes=side == "on" or not prefixes,
                               checkpoint_every=0, precision="fp32" if rows else "auto")
        trainers[side] = Trainer(load_model(path, dtype=torch.float32), home / side, config)

    def use(side: str) -> None:
        if args.compare == "kernels":
            mm.TRAIN_KERNELS = side == "on"
    lp = {}
    with torch.no_grad():
        for side, t in trainers.items():
            use(side)
            lp[side] = torch.cat([o.logprobs for o in t.forward_batch(samples)])
    diff = float((lp["on"] - lp["off"]).abs().max())
    times = {"off": [], "on": []}
    for r in range(args.rounds):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            t = trainers[side]
            t.model.load_state_dict(start)
            use(side)
            t0 = time.perf_counter()
            t.step(samples)
            times[side].append(time.perf_counter() - t0)
            print(f"round {r + 1} {names[side]}: {times[side][-1]:.1f}s", flush=True)
    use("on")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median step: {names['off']} {med['off']:.1f}s, {names['on']} {med['on']:.1f}s; "
          f"max |logprob difference| {diff:.2e}")
    if args.json:
        print(json.dumps({"samples": len(samples), "fed": fed, "times": times, "max_diff": diff}))
    print(f"speed-up ({names['off']} / {names['on']}): {med['off'] / med['on']:.2f}x")


if __name__ == "__main__":
    main()
