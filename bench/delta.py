"""Delta codec benchmark: compression ratio and throughput on real learner updates.

Real mode (default): the GRPO learner (`learner.trainer.Trainer`, its defaults but the
learning rate: AdamW, fp32 masters, grad clip 1, router replay, bf16 published versions)
trains on groups it samples itself: each step, the newest published weights (bf16, our
engine) sample G completions at temperature 1 for train-split task prompts
(`learner.tasks.generate`) rendered by the chat template, recording logprobs and routes.
Real grading would tie every group of a small or random model (every episode fails, so no
gradient), so the reward is the learner's own toy reward: the share of the completion's
tokens starting with a letter a-m (`learner.toy.toy_reward`). After `--warmup`
steps (Adam's moments filled), the published states before and after each of the next
`--updates` steps are delta-encoded. Masters are `settle`d by default (each fp32 master at a
random offset within its bf16 rounding cell, as after a long run; `--start checkpoint`: on
the bf16 grid, as in the first steps from a bf16 checkpoint, where far fewer weights move).

Models (`--model`): "test", the random ~0.5 B test shape of bench/decode.py; "default", the
shipped default model, else a random init of the recipe's default shape (vocab 8192); or a
checkpoint directory (e.g. one the recipe trained). Random checkpoints get the byte-level
tokenizer.

Synthetic mode (`--synthetic`): a random MoE-shaped parameter set takes `torch.optim.AdamW`
steps on a random loss. Store mode (`--store DIR`): consecutive versions of a version store.

Prints, per update: changed fraction, full size, the zstd(full) and zstd(XOR) baselines
(same run, same zstd level), delta size, encode throughput (all cores), decode throughput
(verify and patch in place, one core), and the ratio full/delta last. Throughput is MB of
full state per second.

    python bench/delta.py --model PATH                      # default-shaped: ~2 s a step
    python bench/delta.py --model test --groups 1 --new-tokens 32 --warmup 3
                        # ~0.5 B test shape: ~11 GB of RAM, ~70 s a step on 2 cores (~20 min)
    python bench/delta.py --model PATH --start checkpoint --lr 3e-6
    python bench/delta.py --synthetic --preset 0.5b         # ~0.47B parameters (~12 GB RAM)
    python bench/delta.py --store ~/.apprentice/versions --last 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import zstandard

from agent_runtime import delta
from learner.config import LossConfig, OptimConfig, TrainerConfig
from learner.grpo import Episode, Group, TrainSample, group_samples
from learner.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass
class MoEShape:
    vocab: int = 32768
    d_model: int = 512
    layers: int = 4
    experts: int = 8
    expert_ffn: int = 512


PRESETS = {"tiny": MoEShape(), "0.5b": MoEShape(vocab=65536, d_model=1024, layers=8,
                                                experts=24, expert_ffn=512)}


def moe_parameters(shape: MoEShape, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """Qwen-MoE-like tensors (fused experts) as fp32 master weights."""
    g = torch.Generator().manual_seed(seed)
    d, f, e = shape.d_model, shape.expert_ffn, shape.experts
    shapes = {"embed_tokens.weight": (shape.vocab, d), "lm_head.weight": (shape.vocab, d),
              "norm.weight": (d,)}
    for i in range(shape.layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d, d),
                       p + "self_attn.v_proj.weight": (d, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate.weight": (e, d), p + "mlp.experts.gate_up_proj": (e, 2 * f, d),
                       p + "mlp.experts.down_proj": (e, d, f)})
    params = {}
    for name, s in shapes.items():
        t = torch.ones(s) if name.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02
        params[name] = torch.nn.Parameter(t)
    return params


def adamw_updates(params: dict, lr: float, warmup: int = 2, seed: int = 1):
    """bf16 states before and after one AdamW step (after `warmup` steps fill its moments)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.01)
    publish = lambda: {k: p.detach().to(torch.bfloat16) for k, p in params.items()}  # noqa: E731
    old = None
    for step in range(warmup + 1):
        if step == warmup:
            old = publish()
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in params.values())
        loss.backward()
        opt.step()
    return old, publish()


def concat_words(state: dict) -> np.ndarray:
    return np.concatenate([delta._words(state[k]) for k in sorted(state)])


def measure(label: str, old: dict, new: dict, level: int) -> dict:
    """Ratio and throughput of one update, next to the zstd(full) and zstd(XOR) baselines.

    Encode runs on all cores (the learner's side); decode is `apply_` (verify, then patch in
    place, with the base's cached block digests: the runtime's path) on one core: codec and
    torch both limited to one thread. The patched state is checked bit-identical to `new`.
    """
    full = sum(t.numel() * t.element_size() for t in new.values())
    a, b = concat_words(old), concat_words(new)
    z = zstandard.ZstdCompressor(level=level, threads=-1)
    zfull, zxor = len(z.compress(b)), len(z.compress(a ^ b))
    changed = float(np.count_nonzero(a != b)) / a.size
    del a, b
    t0 = time.perf_counter()
    blob = delta.encode(old, new, level=level)
    t1 = time.perf_counter()
    digests = delta.tensor_digests(old)
    target = {k: v.clone() for k, v in old.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t2 = time.perf_counter()
        delta.apply_(target, blob, digests=digests, threads=1)
        t3 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    assert delta.state_sha256(target) == delta.state_sha256(new), "round trip failed"
    assert all(torch.equal(target[k].view(-1).view(delta._TORCH_INT[v.element_size()]),
                           v.view(-1).view(delta._TORCH_INT[v.element_size()]))
               for k, v in new.items()), "round trip not bit-exact"
    mb = full / 1e6
    return {"update": label, "changed": f"{changed:.2%}", "full MB": f"{mb:.0f}",
            "zstd(full)": f"{full / zfull:.2f}x", "zstd(xor)": f"{full / zxor:.1f}x",
            "delta MB": f"{len(blob) / 1e6:.2f}", "encode MB/s": f"{mb / (t1 - t0):.0f}",
            "decode MB/s per core": f"{mb / (t3 - t2):.0f}", "ratio": f"{full / len(blob):.1f}x"}


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(r[c].rjust(w) for c, w in zip(cols, widths)), flush=True)


def store_updates(root: str, last: int):
    from learner.versions import VersionStore        # bench only; the runtime never does this

    store = VersionStore(root)
    latest = store.latest().version
    for v in range(max(2, latest - last + 1), latest + 1):
        yield f"v{v - 1}->v{v}", store.state(v - 1), store.state(v)


# ---------------------------------------------------------------------------- real updates

def checkpoint(spec: str, tmp: Path) -> tuple[Path, str]:
    """("test" | "default" | a checkpoint dir) -> (checkpoint dir, what it is).

    "test": bench/decode.py's random ~0.5 B test shape; "default": the shipped default model,
    else a random init of the recipe's default shape (`ModelShape()`, vocab 8192). Random
    checkpoints get the model-free byte-level tokenizer and the default chat template."""
    from agent_runtime.model import save_model
    from agent_runtime.model.tokenizer import byte_level_tokenizer
    from agent_runtime.policies import resolve_model_path

    if spec == "test":
        from decode import make_checkpoint
        path = make_checkpoint(tmp / "test-shape")
        byte_level_tokenizer().save(path)
        return path, "random ~0.5B test shape (bench/decode.py)"
    if spec != "default":
        return resolve_model_path(spec), f"the checkpoint {spec}"
    try:
        return resolve_model_path("default"), "the shipped default model"
    except FileNotFoundError:
        from learner.recipe.pretrain import ModelShape, init_model
        tok = byte_level_tokenizer()
        vocab = SimpleNamespace(vocab_size=8192, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
        path = save_model(init_model(ModelShape(), vocab), tmp / "default-shape", "bfloat16")
        tok.save(path)
        return path, "random init of the default shape (ModelShape(), vocab 8192; none shipped)"


def rollout_group(policy, prompt: str, group_size: int, new_tokens: int,
                  loss: LossConfig) -> tuple[list[TrainSample], list[float]]:
    """G completions of one prompt sampled by `policy` (logprobs and routes recorded), scored
    with the learner's toy reward; the learner's group advantages -> training samples."""
    from learner.toy import token_pieces, toy_reward

    ids = policy.render([{"role": "user", "content": prompt}])
    gens = policy.generate([ids] * group_size, new_tokens)
    rewards = [toy_reward(token_pieces(policy.tokenizer, g.tokens, policy.stop_token_ids))
               for g in gens]
    group = Group(prompt[:40], [Episode(str(i), r) for i, r in enumerate(rewards)],
                  [[{"prompt_ids": ids, "completion_ids": g.tokens, "logprobs": g.logprobs,
                     "routes": g.routes.numpy() if g.routes is not None else None,
                     "policy_version": policy.version}] for g in gens])
    return group_samples(group, loss), rewards


@torch.no_grad()
def settle(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every fp32 master a random offset within its bf16 rounding cell, as after a long
    run; the bf16 weights published from them stay bit-identical.

    Masters loaded from a bf16 checkpoint sit exactly on the bf16 grid, so a weight's bf16
    value only moves once its updates add up to half a unit in the last place: in the first
    steps of a run nearly only the smallest weights change. After many steps the masters sit
    anywhere within their cells and each step flips a weight with probability ~|update| / ulp.
    """
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        words = p.data.view(torch.int32)                       # fp32 bit patterns
        grid = (words >> 16) << 16
        if not torch.equal(words, grid):                        # an fp32 checkpoint: off the
            continue                                           # grid already
        r = torch.randint(-0x7FFF, 0x8000, words.shape, generator=g, dtype=torch.int32)
        r = torch.where((words & 0x7FFFFFFF) == 0, r.abs(), r)       # +-0: stay on its side
        r = torch.where((words & 0x7F800000) == 0x7F800000, 0, r)    # inf / nan: untouched
        words += r                                  # |r| < 0x8000: still rounds to the word


def real_updates(path: Path, lr: float, args: argparse.Namespace, run_dir: Path):
    """GRPO steps of `learner.trainer.Trainer` at `lr` from the checkpoint at `path`: after
    `args.warmup` steps, yields (label, published state before, published state after) for
    each of the next `args.updates` steps. Every step samples fresh groups with the newest
    published (bf16) weights, on train-split task prompts rendered by the chat template.
    With `args.settled`, the masters are first `settle`d (published weights unchanged)."""
    from agent_runtime.model import load_model
    from agent_runtime.policies import load_policy
    from learner import tasks

    torch.manual_seed(args.seed)
    config = TrainerConfig(optim=OptimConfig(lr=lr), checkpoint_every=0)
    trainer = Trainer(load_model(path, dtype=torch.float32), run_dir, config)
    if args.settled:
        settle(trainer.model, args.seed)
    trainer.publish()
    policy = load_policy(str(path), dtype="bfloat16", temperature=config.temperature)
    n = (args.warmup + args.updates) * args.groups
    prompts = [t.instruction for t in tasks.generate("train", n, seed=args.seed)]
    for step in range(args.warmup + args.updates):
        state = trainer.published
        policy.swap_state(lambda live: [live[k].copy_(state[k]) for k in live], trainer.version)
        samples, rewards, t0 = [], [], time.perf_counter()
        for prompt in prompts[step * args.groups:(step + 1) * args.groups]:
            got, r = rollout_group(policy, prompt, args.group_size, args.new_tokens, config.loss)
            samples += got
            rewards += r
        t1 = time.perf_counter()
        row = trainer.step(samples)
        trainer.optimizer.zero_grad(set_to_none=True)      # free the gradients while we measure
        print(f"#   lr {lr:g} step {step + 1}: {len(samples)} samples, {row['tokens']} tokens, "
              f"reward {np.mean(rewards):.3f}, loss {row['loss']:.4f}, grad norm "
              f"{row['grad_norm']:.3g}, rollout {t1 - t0:.0f}s, train {row['train_s']:.0f}s",
              flush=True)
        if step >= args.warmup:
            yield f"GRPO lr={lr:g} step {step + 1}", state, trainer.published
    del trainer, policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="test",
                        help="real mode: 'test' (~0.5B test shape), 'default' or a checkpoint dir")
    parser.add_argument("--warmup", type=int, default=4, help="GRPO steps before measuring")
    parser.add_argument("--updates", type=int, default=1, help="measured updates per lr")
    parser.add_argument("--groups", type=int, default=2, help="task groups per step")
    parser.add_argument("--group-size", type=int, default=4, help="G: samples per group")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", choices=["settled", "checkpoint"], default="settled",
                        help="fp32 masters: 'settled' anywhere within their bf16 cells, as "
                        "after a long run (default), or exactly the bf16 checkpoint, as in "
                        "the first steps of a run (far fewer weights change)")
    parser.add_argument("--synthetic", action="store_true",
                        help="random-gradient AdamW on a random parameter set instead")
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="with --synthetic")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    parser.add_argument("--level", type=int, default=delta.ZSTD_LEVEL, help="zstd level")
    parser.add_argument("--store", help="bench consecutive versions of this version store")
    parser.add_argument("--last", type=int, default=3, help="with --store: how many updates")
    args = parser.parse_args()
    args.settled = args.start == "settled"
    tmp = tempfile.TemporaryDirectory()
    if args.store:
        updates = store_updates(args.store, args.last)
    elif args.synthetic:
        shape = PRESETS[args.preset]
        updates = ((f"AdamW lr={lr:g}", *adamw_updates(moe_parameters(shape), lr)) for lr in args.lr)
        print(f"# synthetic {args.preset}: {shape}", flush=True)
    else:
        path, what = checkpoint(args.model, Path(tmp.name))
        print(f"# real GRPO updates of {what}: learner Trainer defaults but lr, bf16 published; "
              f"masters {args.start}; {args.warmup} warm-up steps, then {args.updates} measured per lr; each step "
              f"{args.groups} groups x G={args.group_size} completions of {args.new_tokens} "
              f"tokens sampled at temperature 1 from the current version, routes replayed; "
              f"reward: the learner's toy reward (share of tokens starting with a-m)",
              flush=True)
        updates = (u for i, lr in enumerate(args.lr)
                   for u in real_updates(path, lr, args, Path(tmp.name) / f"run-{i}"))
    rows = []
    for label, old, new in updates:
        rows.append(measure(label, old, new, args.level))
    print(f"# {sum(t.numel() for t in new.values()) / 1e6:.0f}M parameters, "
          f"{os.cpu_count()} cores, zstd level {args.level}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; encode on all cores, decode = "
          f"verify + patch in place (apply_) on one core")
    print_table(rows)


if __name__ == "__main__":
    main()
