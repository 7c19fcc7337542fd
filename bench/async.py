"""Asynchronous vs synchronous GRPO pipeline for a fixed wall time on the same compute.

    python bench/async.py                          # toy tasks, 120 s per setting
    python bench/async.py --seconds 300 --tasks sim
    python bench/async.py --json out.json

Same model (bench/replay.py's small qwen3_moe), same tasks, same batch shape, same machine.
Settings, each for `--seconds` of wall time in this process:

  sync  T threads   generate a batch, then train on it; torch gets T intra-op threads, so each
                    phase may use every core (run for each T in --sync-threads)
  async 1 thread    one rollout worker thread and the trainer thread run at once, torch at one
                    intra-op thread each (two threads on two cores: the same compute)

Reported per setting: optimizer steps, episodes generated and trained on per hour, trainer
idle fraction (time the trainer waited for rollouts / wall time), staleness of trained
samples, and the async / best-sync ratio of episodes trained per hour. Checkpoints are off
in every setting (publishing versions stays on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import make_agent_checkpoint  # noqa: E402


def run_setting(ckpt: Path, tmp: Path, mode: str, threads: int, a) -> dict:
    from agent_runtime.store import SessionStore
    from learner import config as c
    from learner.pipeline import build
    from learner.versions import VersionStore

    name = f"{mode}-{threads}"
    cfg = c.RunConfig(
        model=str(ckpt), tasks=a.tasks,
        trainer=c.TrainerConfig(optim=c.OptimConfig(lr=a.lr), checkpoint_every=0,
                                device=a.device),
        rollout=c.RolloutConfig(group_size=a.group, concurrency=a.group, device=a.device,
                                max_new_tokens=a.tokens, max_steps=a.max_steps),
        pipeline=c.PipelineConfig(mode=mode, steps=10**9, groups_per_step=a.groups_per_step,
                                  torch_threads=threads, seed=a.seed))
    torch.manual_seed(a.seed)
    with SessionStore(tmp / name / "home") as store:
        pipe = build(cfg, tmp / name / "run", store, VersionStore(tmp / name / "versions"))
        s = pipe.run(max_seconds=a.seconds)
    hours = s.wall_s / 3600
    return {"setting": f"{mode} {threads} thread{'s' if threads > 1 else ''}", "mode": mode,
            "threads": threads, "wall_s": round(s.wall_s, 1), "steps": s.steps,
            "episodes_generated": s.episodes_generated, "episodes_trained": s.episodes_trained,
            "generated_per_hour": s.episodes_generated / hours,
            "trained_per_hour": s.episodes_trained / hours,
            "steps_per_hour": s.steps / hours, "trainer_idle": s.idle_fraction,
            "trainer_busy_s": round(s.trainer_busy_s, 1),
            "staleness_mean": sum(s.staleness) / len(s.staleness) if s.staleness else 0.0,
            "stale_dropped": s.samples_stale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="wall time per setting")
    ap.add_argument("--tasks", default="toy", choices=["toy", "sim"])
    ap.add_argument("--group", type=int, default=8, help="episodes per task (G)")
    ap.add_argument("--groups-per-step", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens per model call")
    ap.add_argument("--max-steps", type=int, default=4, help="model calls per sim episode")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--sync-threads", default="1,2", help="torch threads for sync settings")
    ap.add_argument("--device", default="cpu", help="where rollouts and training run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    a = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, affinity: {len(os.sched_getaffinity(0))}, torch "
          f"{torch.__version__}, {a.seconds:.0f} s per setting, tasks {a.tasks}, G {a.group}, "
          f"{a.groups_per_step} groups/step, {a.tokens} tokens/call, device {a.device}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = make_agent_checkpoint(tmp / "ckpt")
        settings = [("sync", int(t)) for t in a.sync_threads.split(",")] + [("async", 1)]
        for mode, threads in settings:
            r = run_setting(ckpt, tmp, mode, threads, a)
            results.append(r)
            print(f"{r['setting']:>16}: {r['steps']:>4} steps, {r['episodes_trained']:>5} "
                  f"episodes trained ({r['trained_per_hour']:8.0f}/h, generated "
                  f"{r['generated_per_hour']:8.0f}/h), "
                  f"trainer idle {100 * r['trainer_idle']:5.1f}%, "
                  f"staleness {r['staleness_mean']:.2f}, stale dropped {r['stale_dropped']}",
                  flush=True)
    best = max((r for r in results if r["mode"] == "sync"), key=lambda r: r["trained_per_hour"])
    asy = next(r for r in results if r["mode"] == "async")
    ratio = asy["trained_per_hour"] / best["trained_per_hour"] if best["trained_per_hour"] else 0
    print(f"async / best sync ({best['setting']}): {ratio:.2f}x episodes trained per hour; "
          f"trainer idle {100 * asy['trainer_idle']:.1f}% vs {100 * best['trainer_idle']:.1f}%")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "results": results, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
