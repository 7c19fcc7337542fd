"""Replay recorded learning cycles offline: what the online updates did to the model, measured
without sampling a session.

bench/online.py measures what a user would see (sampled sessions, greedy held-out episodes),
and each of its numbers moves by a task or a standard error from one run to the next. This
replays the cycles such a run (or a user's daemon) recorded, with no decoding at all: from
version 1 of the home's version line, each recorded cycle's rated samples (their rewards, a
running baseline as the learner keeps it) train from the previous replayed candidate through
`learner.online.OnlineLearner.update` (the learner's steps, sparse projection and trust
region), once per setting of which weights train. After each cycle it scores the candidate
teacher-forced on held-out oracle episodes (`learner.recipe.sft.assistant_metrics`: loss per
assistant token, exact tokens, exact turns: how far the greedy continuation of an oracle's
episode drifts, which no sampling noise moves). At the end, the decision the bench's
simulated user rates: at the
moments of the home's other sessions where the model called `finish` without having run the
tests, the probability that it runs them instead (a recorded test run's completion against
the recorded `finish`, the two as the only choices).

    python bench/online_replay.py --home DIR                  # a bench/online.py --home DIR
    python bench/online_replay.py --home DIR --cycles 4 --trainable experts,all

Settings (`--trainable`): `experts` is the learner's default (`learner.online.TRAINABLE`),
`all` every weight, anything else a comma-free regex of parameter names. The cycles replay
as recorded, whichever the gate published: what one setting does over the same rated data.
Nothing is written to the home (the replay's trainer works in a temporary folder).
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
sys.path.insert(0, str(ROOT / "bench"))

from online import TEST_RE  # noqa: E402  (the simulated user's idea of a test run)


def _test_run(call: dict) -> bool:
    return call["name"] == "run_command" and bool(
        TEST_RE.search(str((call["arguments"] or {}).get("command", ""))))


def heldout_turns(model_dir: Path, tasks: int, work: Path) -> list:
    """The oracle's episodes on `tasks` held-out instances, as (ids, mask) sequences in the
    model's own harness (its chat template, the mention block if it was trained with one)."""
    from agent_runtime.mentions import CONFIG_KEY
    from learner.recipe import sft
    config = json.loads((model_dir / "config.json").read_text())
    sft.collect(model_dir, work / "heldout.npz",
                sft.SFTConfig(workers=1, mentions=bool(config.get(CONFIG_KEY))),
                split="heldout", tasks=tasks)
    return sft.load_sequences(work / "heldout.npz")


def decision_moments(store, replayed: set[str], tok) -> tuple[list, list[int] | None]:
    """([(prompt ids, finish prefix ids)] of the moments a session outside `replayed` called
    `finish` with no test run before it, a recorded test run's completion ids or None)."""
    moments, test_run = [], None
    for row in store.db.query("SELECT id FROM sessions ORDER BY created_at"):
        sid = row["id"]
        calls = store.tool_calls(sid)
        if test_run is None:
            for c in calls:
                if _test_run(c):
                    done = [s for s in store.samples(sid) if s["message_id"] == c["message_id"]]
                    if done:
                        test_run = list(done[-1]["completion_ids"])
                        break
        if sid in replayed:
            continue
        names = [c["name"] for c in calls]
        if "finish" not in names:
            continue
        at = names.index("finish")
        if any(_test_run(c) for c in calls[:at]):
            continue
        rows = [s for s in store.samples(sid) if s["message_id"] == calls[at]["message_id"]]
        if not rows:
            continue
        comp = list(rows[-1]["completion_ids"])
        k = next((i for i in range(1, len(comp) + 1) if '"finish"' in tok.decode(comp[:i])),
                 len(comp))
        moments.append((list(rows[-1]["prompt_ids"]), comp[:k]))
    return moments, test_run


def decision(model, moments: list, test_run: list[int]) -> float:
    """Mean over the moments of P(test run) / (P(test run) + P(finish))."""
    import torch

    def logprob(prompt: list[int], completion: list[int]) -> float:
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        return float(torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(completion)[:, None]).sum())
    with torch.no_grad():
        d = torch.tensor([logprob(p, test_run) - logprob(p, f) for p, f in moments])
    return float(torch.sigmoid(d).mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, required=True, help="an $APPRENTICE_HOME with cycles")
    p.add_argument("--model", default=None, help="default: the version line's base model")
    p.add_argument("--cycles", type=int, default=None, help="the first N recorded cycles")
    p.add_argument("--trainable", default="experts,all")
    p.add_argument("--heldout-tasks", type=int, default=64)
    p.add_argument("--negatives", choices=("all", "decision"), default="all",
                   help="the tokens of a disliked call that train (LossConfig.negatives)")
    args = p.parse_args(argv)

    import torch
    from agent_runtime.model import load_model, load_tokenizer
    from agent_runtime.policies import resolve_model_path
    from agent_runtime.store import SessionStore
    from learner.online import BASE_FILE, TRAINABLE, OnlineConfig, OnlineLearner
    from learner.recipe.sft import assistant_metrics
    from learner.sentiment import sample_rewards
    from learner.versions import VersionStore

    versions = VersionStore(args.home / "versions")
    marker = versions.root / BASE_FILE
    line = json.loads(marker.read_text()) if marker.exists() else {}
    try:
        model_dir = resolve_model_path(args.model or line.get("model") or "default")
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc}: the version line's base model; name it with --model") from None
    store = SessionStore(args.home)
    cycles = [dict(r) for r in store.db.query(
        "SELECT id, sample_ids FROM learner_cycles WHERE sample_ids IS NOT NULL ORDER BY id")]
    cycles = [c for c in cycles if json.loads(c["sample_ids"])][:args.cycles]
    if not cycles:
        raise SystemExit(f"{args.home}: no recorded learning cycle")
    work = Path(tempfile.mkdtemp(prefix="apprentice-replay-"))
    t0 = time.monotonic()
    held = heldout_turns(model_dir, args.heldout_tasks, work)
    tok = load_tokenizer(model_dir)
    rated = [(c["id"], json.loads(c["sample_ids"])) for c in cycles]
    replayed = {r["session_id"] for _, ids in rated for r in store.samples_by_id(ids)}
    moments, test_run = decision_moments(store, replayed, tok)
    print(f"{len(cycles)} cycles, {sum(len(i) for _, i in rated)} samples; {len(held)} held-out "
          f"oracle episodes; {len(moments)} decision moments ({time.monotonic() - t0:.0f}s)",
          flush=True)
    base = versions.state(int(line.get("version", 1)))
    model = load_model(model_dir, dtype=torch.float32)

    def score(state, decide: bool = True) -> dict:
        model.load_state_dict({k: v.float() for k, v in state.items()})
        m = assistant_metrics(model, held)
        if decide and moments and test_run:
            m["decision"] = decision(model, moments, test_run)
        return m

    def row(m: dict) -> str:
        return (f"loss {m['loss']:.4f}  tokens {100 * m['token_accuracy']:.2f}%  turns exact "
                f"{100 * m['turns_exact']:.1f}%"
                + (f"  P(tests | finish) {m['decision']:.3f}" if "decision" in m else ""))

    start = score(base)
    print(f"version 1: {row(start)}", flush=True)
    ends = {}
    for setting in args.trainable.split(","):
        trainable = {"experts": TRAINABLE, "all": ()}.get(setting, (setting,))
        config = OnlineConfig(model=str(model_dir))
        config.trainer.trainable = trainable
        config.trainer.loss.negatives = args.negatives
        learner = OnlineLearner(store, config)
        learner.dir = work / setting                  # the trainer's files: not in the home
        state, history = base, []
        for n, (cycle_id, ids) in enumerate(rated, 1):
            t1 = time.monotonic()
            rewards = sample_rewards(store, ids)
            recent = history[-config.baseline_window:]
            samples = learner.train_samples(ids, rewards, 0, baseline=(
                sum(recent) / len(recent) if recent else 0.0))
            history += [r for r in (rewards.get(i, 0.0) for i in ids) if r]
            trainer = learner.trainer_for(state)
            moved = learner.update(trainer, state, samples, cycle_id)
            state = trainer.published_state()
            m = score(state, decide=n == len(rated))          # the decision after the last
            print(f"{setting} cycle {cycle_id}: {len(samples)} samples, moved {moved:.2e}: "
                  f"{row(m)} ({time.monotonic() - t1:.0f}s)", flush=True)
        ends[setting] = m
        print(f"{setting} after {len(rated)} cycles: {row(ends[setting])}", flush=True)
    print("loss drift per held-out assistant token: " + ", ".join(
        f"{k} {m['loss'] - start['loss']:+.4f}" for k, m in ends.items()))


if __name__ == "__main__":
    main()
