"""Expert iteration on simulated tasks: the model's own verified passes, fine-tuned on.

    python -m learner.recipe.rft START_MODEL OUT [--oracle DIR/sft_data/data.npz] [--rounds 2]

Each round, the current model runs `tasks` fresh train-split simulated tasks
(`generate("train", tasks, seed=task_seed + round)`) at `temperature`, several at once (their
model calls decode as one batch), graded by the hidden tests. The episodes that pass, and that
the grader did not flag as cheating, become training sequences exactly as the model wrote
them (`sft.merge_samples` over the recorded prompt and completion ids: each call's completion
is trained on, the tool results are context); then the model is fine-tuned on them, mixed
with `oracle_mix` oracle sequences per own one (so the families it never passes keep their
teacher), and the next round starts from the result.

This is rejection-sampling fine-tuning (Yuan et al., 2023), STaR (Zelikman et al., 2022) or
ReST-EM (Singh et al., 2023): policy improvement with a binary verifiable reward, the
positive half of GRPO's signal. Why it and not more GRPO on this CPU: a GRPO group needs
`group_size` episodes of one task, and a group whose episodes all pass or all fail trains
nothing; the recipe's GRPO stage spent 3 of 4 steps on such groups (README, "The shipped
model"). Here every task costs one episode and every pass trains, and an episode is trained
as one sequence (prompt tokens once, not once per call). What it cannot do: learn from a
failure, or teach a family the model never passes (`implement_function`, `add_feature`).

A round's folder (`OUT/round-N/`) holds `data.npz` (its own passes), `metrics.json` (written
last: the round is done) and `model/`; a rerun resumes at the first round not done, inside
`sft.run`'s own checkpoints. `OUT/model` is the last round's model.

Not here: the tasks (`learner.tasks`), grading (`learner.rollout`), the optimization
(`learner.recipe.lm`, through `sft.run`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from learner.recipe.lm import LMConfig
from learner.recipe.sft import SFTConfig, load_sequences, merge_samples, run as sft_run, \
    save_sequences


@dataclass
class RFTConfig:
    rounds: int = 2                 # collect-then-train rounds
    tasks: int = 192                # train-split tasks per round, one episode each
    task_seed: int = 50_000         # round r draws generate("train", tasks, seed=task_seed + r)
                                    # (SFT's oracle data is seed 0, the online bench 0..20,000+)
    temperature: float = 1.0        # rollout sampling
    concurrency: int = 8            # episodes at once (their calls decode as one batch)
    max_steps: int = 12             # model calls per episode
    max_new_tokens: int = 256       # tokens per model call
    oracle_mix: float = 1.0         # oracle sequences drawn per own sequence (0: own only)
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        train=LMConfig(steps=60, lr=1e-4, warmup=5, weight_decay=0.0, min_lr_ratio=0.1,
                       checkpoint_every=20, log_every=10, head_on_mask=True),
        batch_tokens=4096, rename=0.0))   # the fine-tuning of each round
    sandbox: str | None = None      # "auto" | "off" | "require"; None: $APPRENTICE_SANDBOX
    seed: int = 0                   # which oracle sequences are mixed in


def collect(model_dir: Path, out: Path, config: RFTConfig, round_: int,
            policy_for: Callable[[Any], Any] | None = None) -> dict:
    """Run the model in `model_dir` on the round's tasks (or `policy_for(task)`'s policy, which
    must render with that model's tokenizer); save its passing episodes' sequences to `out`."""
    import tempfile

    from agent_runtime.agent import AgentConfig
    from agent_runtime.model import load_tokenizer
    from agent_runtime.names import ORIGIN_ROLLOUT
    from agent_runtime.store import SessionStore
    from learner.practice import honest_passes
    from learner.rollout import run_episodes
    from learner.tasks import generate

    if policy_for is None:
        from agent_runtime.policies.batching import shared
        from agent_runtime.policies.engine import EnginePolicy
        engine = EnginePolicy.load(str(model_dir), temperature=config.temperature,
                                   dtype="bfloat16", max_new_tokens=config.max_new_tokens)
        policy = shared(engine, config.concurrency)
        policy_for = lambda _task: policy                     # noqa: E731
    eos = load_tokenizer(model_dir).special_tokens["<|im_end|>"]
    tasks = generate("train", config.tasks, seed=config.task_seed + round_)
    t0 = time.time()
    seqs, families = [], {}
    with tempfile.TemporaryDirectory(prefix="apprentice-rft-") as home, \
            SessionStore(home) as store:
        episodes = run_episodes(policy_for, tasks, store, concurrency=config.concurrency,
                                sandbox=config.sandbox, origin=ORIGIN_ROLLOUT,
                                agent_config=AgentConfig(max_steps=config.max_steps))
        passes = honest_passes(store, episodes)
        for ep, samples in passes:
            seqs.extend(merge_samples(samples, eos)[0])
        passed = {ep.session_id for ep, _ in passes}
        for task, ep in zip(tasks, episodes):
            done = families.setdefault(task.family, [0, 0])
            done[0], done[1] = done[0] + (ep.session_id in passed), done[1] + 1
    save_sequences(out, seqs)
    return {"tasks": len(tasks), "passed": sum(p for p, _ in families.values()),
            "families": {f: f"{p}/{n}" for f, (p, n) in sorted(families.items())},
            "sequences": len(seqs), "tokens": sum(len(s[0]) for s in seqs),
            "trained_tokens": sum(sum(s[1]) for s in seqs), "seconds": round(time.time() - t0, 1)}


def mixed(own: Path, oracle: Path | None, share: float, seed: int, out: Path) -> int:
    """Write `own`'s sequences plus `share` x as many drawn from `oracle` to `out`."""
    seqs = load_sequences(own)
    extra = []
    if oracle is not None and share > 0 and seqs:
        pool = load_sequences(oracle)
        extra = random.Random(seed).sample(pool, min(len(pool), round(share * len(seqs))))
    save_sequences(out, seqs + extra)
    return len(extra)


def run(start_dir: Path, out: Path, config: RFTConfig, oracle: Path | None = None,
        log=print, policy_for: Callable[[Any], Any] | None = None) -> dict:
    """`config.rounds` rounds from the model in `start_dir`; `out/model` is the last one.
    `policy_for` replaces the model as the one collecting (tests)."""
    out.mkdir(parents=True, exist_ok=True)
    current, rounds = Path(start_dir), []
    for r in range(config.rounds):
        folder = out / f"round-{r}"
        done = folder / "metrics.json"
        if done.exists():
            rounds.append(json.loads(done.read_text()))
            current = folder / "model"
            continue
        folder.mkdir(exist_ok=True)
        own = folder / "own.npz"
        if not own.exists():
            got = collect(current, folder / "own.tmp.npz", config, r, policy_for)
            (folder / "collect.json").write_text(json.dumps(got, indent=1))
            (folder / "own.tmp.npz").rename(own)
        got = json.loads((folder / "collect.json").read_text())
        log({"round": r, **{k: got[k] for k in ("passed", "tasks", "sequences", "seconds")},
             "families": got["families"]})
        metrics = {"round": r, "collect": got}
        if got["sequences"]:
            data = folder / "data.npz"
            metrics["oracle_sequences"] = mixed(own, oracle, config.oracle_mix,
                                                config.seed + r, data)
            sft_cfg = replace(config.sft, seed=config.seed + r)
            trained = sft_run(current, data, folder, sft_cfg, log)
            metrics["train"] = {k: trained[k] for k in ("sequences", "seconds", "steps",
                                                        "final_loss")}
        else:                                  # nothing passed: the model stays as it was
            shutil.copytree(current, folder / "model", dirs_exist_ok=True)
        current = folder / "model"
        done.write_text(json.dumps(metrics, indent=1))
        rounds.append(metrics)
    if (out / "model").exists():
        shutil.rmtree(out / "model")
    shutil.copytree(current, out / "model")
    return {"rounds": rounds, "config": asdict(config)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.recipe.rft",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("start", help="model folder to start from (the SFT checkpoint)")
    p.add_argument("out", help="output folder (rerun to resume)")
    p.add_argument("--oracle", help="oracle sequences to mix in (a recipe's sft_data/data.npz)")
    p.add_argument("--rounds", type=int, default=RFTConfig.rounds)
    p.add_argument("--tasks", type=int, default=RFTConfig.tasks)
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps per round")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--oracle-mix", type=float, default=RFTConfig.oracle_mix)
    p.add_argument("--temperature", type=float, default=RFTConfig.temperature)
    p.add_argument("--concurrency", type=int, default=RFTConfig.concurrency)
    args = p.parse_args(argv)
    base = RFTConfig()
    config = replace(base, rounds=args.rounds, tasks=args.tasks, oracle_mix=args.oracle_mix,
                     temperature=args.temperature, concurrency=args.concurrency,
                     sft=replace(base.sft, train=replace(base.sft.train, steps=args.steps,
                                                         lr=args.lr)))
    result = run(Path(args.start), Path(args.out), config,
                 Path(args.oracle) if args.oracle else None,
                 log=lambda row: print(json.dumps(row), flush=True))
    (Path(args.out) / "metrics.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
