"""Router replay on vs off: K GRPO steps on the same rollouts, flip rate and KL per step.

    python bench/replay.py                        # bf16 rollouts, fp32 trainer, K = 10
    python bench/replay.py --device cuda          # both on a GPU
    python bench/replay.py --rollout-dtype float32 --steps 5
    python bench/replay.py --json out.json

One batch of toy-task groups is generated once by a bf16 rollout policy (the runtime's
numerics). Two trainers start from the same fp32 weights and take K steps on that same batch,
one with router replay, one letting the router choose again. Each step's training forward
(before its update) logs the route-flip rate (share of (token, MoE layer) pairs whose own
top-k set differs from the recorded one; under replay the recorded set is used anyway) and
the k3 KL between behaviour and training logprobs. Step 1 shows pure numerics (bf16 rollout
vs fp32 training); later steps add the policy's drift away from the data.

The model is a small random qwen3_moe (hidden 256, 4 layers, 16 experts top-4) with the
shipped default model's tokenizer and chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH_SHAPE = {  # small enough for a 2-core CPU, routed like a real MoE (16 experts, top-4)
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 128, "intermediate_size": 512, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "hidden_act": "silu", "decoder_sparse_step": 1,
    "mlp_only_layers": [], "attention_bias": False, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None,
}


def make_agent_checkpoint(path: Path, seed: int = 0) -> Path:
    """The default model's tokenizer and chat template with a random MoE of BENCH_SHAPE."""
    import shutil

    from agent_runtime.model import save_model
    from agent_runtime.model.config import args_from_hf
    from agent_runtime.model.model import MoEModel
    from agent_runtime.policies import resolve_model_path
    from learner.recipe.pretrain import TOKENIZER_FILES

    default = resolve_model_path("default")
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default / name, path / name)
    shipped = json.loads((default / "config.json").read_text())
    config = {**BENCH_SHAPE, **{k: shipped[k] for k in ("vocab_size", "bos_token_id",
                                                        "eos_token_id", "pad_token_id")}}
    torch.manual_seed(seed)
    model = MoEModel(args_from_hf(config), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) * 0.5 + 0.75 if "norm" in name
                    else torch.randn_like(p) * 0.05)
    save_model(model, path, dtype="bfloat16")
    return path


def rollout_batch(ckpt: Path, home: Path, dtype: str, groups: int, group_size: int,
                  tokens: int, seed: int, device: str = "cpu"):
    from agent_runtime.policies import load_policy
    from agent_runtime.store import SessionStore
    from learner.config import RolloutConfig
    from learner.grpo import group_samples
    from learner.toy import run_toy_group, toy_tasks

    policy = load_policy(str(ckpt), dtype=dtype, temperature=1.0, max_new_tokens=tokens,
                         device=device)
    policy.version = 1
    store = SessionStore(home)
    torch.manual_seed(seed)
    config = RolloutConfig(group_size=group_size, max_new_tokens=tokens)
    samples = []
    for task in toy_tasks(groups, seed):
        samples += group_samples(run_toy_group(policy, task, store, config))
    return samples


def train_curve(ckpt: Path, run_dir: Path, samples, replay: bool, steps: int, lr: float,
                device: str = "cpu") -> list[dict]:
    from agent_runtime.model import load_model
    from learner.config import OptimConfig, TrainerConfig
    from learner.trainer import Trainer

    torch.manual_seed(0)
    config = TrainerConfig(optim=OptimConfig(lr=lr), router_replay=replay, checkpoint_every=0,
                           device=device)
    trainer = Trainer(load_model(ckpt, dtype=torch.float32), run_dir, config)
    trainer.version = 1
    return [trainer.step(samples) for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="K training steps per setting")
    ap.add_argument("--groups", type=int, default=4, help="task groups in the batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per sample")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--device", default="cpu", help="where rollouts and training run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = make_agent_checkpoint(tmp / "ckpt")
        samples = rollout_batch(ckpt, tmp / "home", a.rollout_dtype, a.groups, a.group_size,
                                a.tokens, a.seed, a.device)
        n_tok = sum(s.n_tokens for s in samples)
        print(f"batch: {len(samples)} samples, {n_tok} completion tokens, rollouts in "
              f"{a.rollout_dtype}, training in float32, lr {a.lr}, device {a.device}")
        curves = {replay: train_curve(ckpt, tmp / f"run-{replay}", samples, replay, a.steps,
                                      a.lr, a.device)
                  for replay in (True, False)}
    on, off = curves[True], curves[False]
    print(f"{'step':>4} | {'flip replay':>11} {'flip no-rep':>11} | {'KL replay':>10} "
          f"{'KL no-rep':>10} | {'max|dlp| rep':>12} {'max|dlp| no':>12}")
    table = []
    for k, (r, n) in enumerate(zip(on, off), 1):
        print(f"{k:>4} | {r['flip_rate']:>11.4f} {n['flip_rate']:>11.4f} | {r['kl']:>10.2e} "
              f"{n['kl']:>10.2e} | {r['max_logprob_diff']:>12.4f} {n['max_logprob_diff']:>12.4f}")
        table.append({"step": k, "flip_replay": r["flip_rate"], "flip_no_replay": n["flip_rate"],
                      "kl_replay": r["kl"], "kl_no_replay": n["kl"],
                      "reward_loss_replay": r["loss"], "reward_loss_no_replay": n["loss"]})
    mean = lambda rows, key: sum(x[key] for x in rows) / len(rows)  # noqa: E731
    print(f"mean | {mean(on, 'flip_rate'):>11.4f} {mean(off, 'flip_rate'):>11.4f} | "
          f"{mean(on, 'kl'):>10.2e} {mean(off, 'kl'):>10.2e} | KL ratio no-replay/replay "
          f"{mean(off, 'kl') / max(mean(on, 'kl'), 1e-30):.1f}x")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "table": table}, indent=1))


if __name__ == "__main__":
    main()
