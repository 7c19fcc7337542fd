"""Asynchronous vs synchronous GRPO pipeline for a fixed wall time on the same compute.

    python bench/async.py                          # toy tasks, 120 s per setting
    python bench/async.py --seconds 300 --tasks sim
    python bench/async.py --settings sync:2,async:process:1 --json out.json
    python bench/async.py --rounds 3 --seconds 40   # interleaved rounds, medians reported
    taskset -c 0,1 python bench/async.py           # two cores of a bigger machine

Same model (bench/replay.py's small qwen3_moe), same tasks, same batch shape, same machine.
Settings (`--settings`, comma-separated), each for `--seconds` of wall time:

  sync:T              generate a batch, then train on it; torch gets T intra-op threads, so
                      each phase may use every core
  async:process:N     N rollout worker processes (the default pipeline: no GIL shared with
                      the trainer, weights through shared memory) and the trainer run at once,
                      torch at one intra-op thread in every process
  async:thread:1      one rollout worker thread inside the trainer's process (shares its GIL)
  ray:N               N rollout workers as Ray actors (`--backend ray`: one placement bundle
                      of one CPU each, weights as codec deltas through the object store) on a
                      local Ray instance started before the settings run; needs the ray extra

Reported per setting: optimizer steps, episodes generated and trained on per hour (over the
whole wall time, which includes starting worker processes, and in steady state: from the
end of the first step to the end), trainer idle fraction (time the trainer waited for
rollouts / wall time), staleness of trained samples, and each async setting's ratio to the
best sync setting in episodes trained per hour; each ray:N setting's ratio to
async:process:N (else the best process setting) is printed last: the price of Ray. With `--rounds R` the settings run R times
in turn (A B C A B C ...) and the medians are reported, so load that other tenants put on a
shared machine falls on every setting alike. Checkpoints are off in every setting
(publishing versions stays on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import make_agent_checkpoint  # noqa: E402

DEFAULT_SETTINGS = "sync:1,sync:2,async:process:1,async:process:2,async:thread:1"


def run_setting(ckpt: Path, tmp: Path, spec: str, a) -> dict:
    from agent_runtime.store import SessionStore
    from learner import config as c
    from learner.pipeline import build
    from learner.versions import VersionStore

    parts = spec.split(":")
    backend = "ray" if parts[0] == "ray" else "local"
    mode = "async" if backend == "ray" else parts[0]
    threads = int(parts[1]) if mode == "sync" else 1
    processes = mode == "async" and parts[1] == "process"
    workers = int(parts[-1]) if mode == "async" else 1
    cfg = c.RunConfig(
        model=str(ckpt), tasks=a.tasks,
        trainer=c.TrainerConfig(optim=c.OptimConfig(lr=a.lr), checkpoint_every=0,
                                device=a.device),
        rollout=c.RolloutConfig(group_size=a.group, concurrency=a.group, device=a.device,
                                max_new_tokens=a.tokens, max_steps=a.max_steps,
                                processes=processes, workers=workers, worker_threads=1,
                                backend=backend),
        pipeline=c.PipelineConfig(mode=mode, steps=10**9, groups_per_step=a.groups_per_step,
                                  torch_threads=threads, seed=a.seed))
    torch.manual_seed(a.seed)
    marks: list[tuple[float, int]] = []               # (time, episodes trained) per step
    name = spec.replace(":", "-")
    with SessionStore(tmp / name / "home") as store:
        pipe = build(cfg, tmp / name / "run", store, VersionStore(tmp / name / "versions"))
        s = pipe.run(max_seconds=a.seconds, on_step=lambda row: marks.append(
            (time.perf_counter(), pipe.stats.episodes_trained)))
        end = time.perf_counter()
    hours = s.wall_s / 3600
    steady = 0.0
    if len(marks) > 1:
        steady = (marks[-1][1] - marks[0][1]) / ((end - marks[0][0]) / 3600)
    return {"setting": spec, "mode": mode, "backend": backend, "wall_s": round(s.wall_s, 1), "steps": s.steps,
            "episodes_generated": s.episodes_generated, "episodes_trained": s.episodes_trained,
            "generated_per_hour": s.episodes_generated / hours,
            "trained_per_hour": s.episodes_trained / hours,
            "trained_per_hour_steady": steady,
            "steps_per_hour": s.steps / hours, "trainer_idle": s.idle_fraction,
            "trainer_busy_s": round(s.trainer_busy_s, 1),
            "staleness_mean": sum(s.staleness) / len(s.staleness) if s.staleness else 0.0,
            "stale_dropped": s.samples_stale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="wall time per setting")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="see the module docstring")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (medians)")
    ap.add_argument("--tasks", default="toy", choices=["toy", "sim"])
    ap.add_argument("--group", type=int, default=8, help="episodes per task (G)")
    ap.add_argument("--groups-per-step", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens per model call")
    ap.add_argument("--max-steps", type=int, default=4, help="model calls per sim episode")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--device", default="cpu", help="where rollouts and training run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    a = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, affinity: {len(os.sched_getaffinity(0))}, torch "
          f"{torch.__version__}, {a.seconds:.0f} s per setting, tasks {a.tasks}, G {a.group}, "
          f"{a.groups_per_step} groups/step, {a.tokens} tokens/call, device {a.device}")
    specs = a.settings.split(",")
    if any(spec.startswith("ray") for spec in specs):
        import ray                                    # one local instance for every ray setting
        ray.init(include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_agent_checkpoint(Path(tmp) / "ckpt")
        for k in range(a.rounds):
            for spec in specs:
                r = run_setting(ckpt, Path(tmp) / f"round{k}", spec, a)
                runs[spec].append(r)
                if a.rounds > 1:
                    print(f"  round {k + 1} {spec}: {r['trained_per_hour']:.0f}/h, steady "
                          f"{r['trained_per_hour_steady']:.0f}/h, idle "
                          f"{100 * r['trainer_idle']:.1f}%", flush=True)
    results = [median_run(runs[spec]) for spec in specs]
    for r in results:
        print(f"{r['setting']:>16}: {r['steps']:>4} steps, {r['episodes_trained']:>5} episodes "
              f"trained ({r['trained_per_hour']:7.0f}/h, steady "
              f"{r['trained_per_hour_steady']:7.0f}/h; generated "
              f"{r['generated_per_hour']:7.0f}/h), trainer idle "
              f"{100 * r['trainer_idle']:5.1f}%, staleness {r['staleness_mean']:.2f}, "
              f"stale dropped {r['stale_dropped']}")
    syncs = [r for r in results if r["mode"] == "sync"]
    ratios = {}
    if syncs:
        best = max(syncs, key=lambda r: r["trained_per_hour"])
        best_steady = max(syncs, key=lambda r: r["trained_per_hour_steady"])
        for r in (r for r in results if r["mode"] == "async"):
            whole = r["trained_per_hour"] / max(best["trained_per_hour"], 1e-9)
            steady = (r["trained_per_hour_steady"]
                      / max(best_steady["trained_per_hour_steady"], 1e-9))
            ratios[r["setting"]] = {"whole": whole, "steady": steady}
            print(f"{r['setting']} / best sync: {whole:.2f}x episodes trained per hour "
                  f"(vs {best['setting']}), {steady:.2f}x in steady state (vs "
                  f"{best_steady['setting']}); trainer idle {100 * r['trainer_idle']:.1f}% vs "
                  f"{100 * best['trainer_idle']:.1f}%")
    for r in (r for r in results if r["backend"] == "ray"):
        n = r["setting"].split(":")[-1]
        local = [x for x in results if x["setting"] == f"async:process:{n}"] or sorted(
            (x for x in results if x["setting"].startswith("async:process")),
            key=lambda x: -x["trained_per_hour"])
        if local:
            base = local[0]
            whole = r["trained_per_hour"] / max(base["trained_per_hour"], 1e-9)
            steady = r["trained_per_hour_steady"] / max(base["trained_per_hour_steady"], 1e-9)
            ratios[f"{r['setting']} / {base['setting']}"] = {"whole": whole, "steady": steady}
            print(f"{r['setting']} / {base['setting']}: {whole:.2f}x episodes trained per hour, "
                  f"{steady:.2f}x in steady state")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "results": results, "ratios": ratios, "runs": runs},
                                     indent=1))


def median_run(rows: list[dict]) -> dict:
    """Per-setting medians over rounds (numbers), the first round's values otherwise."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rows)
    return out


if __name__ == "__main__":
    main()
