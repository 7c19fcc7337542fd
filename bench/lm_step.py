"""A language-model training step of the recipe's `pretrain` and `sft` shapes: the training
kernels in C++ (`model.TRAIN_KERNELS`: RMSNorm, the rotary embedding and the loss's token
log-probabilities) against the PyTorch operations they replace, in one run.

Each step is what `learner.recipe.lm.train_lm` runs: the forward on the bf16 copy of the fp32
masters where the CPU has native bf16 matmuls (`learner.precision`), the mean next-token loss
(every position for `pretrain`, the masked positions' logits only for `sft`), the backward,
the gradients to the masters and an AdamW step. The two ways alternate from the same weights;
it prints each way's median step, the largest difference of their losses, and the speed-up
(PyTorch's operations / C++ kernels) last.

    python bench/lm_step.py                        # the shipped model's shape, both stages
    python bench/lm_step.py --stage pretrain --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"pretrain": (16, 1024, 1.0),   # rows, tokens a row, share of positions trained
          "sft": (4, 1024, 0.3)}         # SFT batches ~4 k tokens, its loss on assistant turns


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--stage", choices=(*SHAPES, "both"), default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = p.parse_args(argv)

    import torch

    from agent_runtime.model import load_model
    from agent_runtime.model import model as mm
    from agent_runtime.policies.base import resolve_model_path
    from learner.precision import Bf16Copy, bf16_compute
    from learner.recipe.lm import masked_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    start = load_model(path, dtype=torch.float32).state_dict()
    bf16 = bf16_compute("auto", "cpu")
    print(f"model {args.model}, {torch.get_num_threads()} threads, forward and backward in "
          f"{'bf16' if bf16 else 'fp32'}", flush=True)
    ratios = []
    for stage in SHAPES if args.stage == "both" else (args.stage,):
        B, T, share = SHAPES[stage]
        g = torch.Generator().manual_seed(0)
        vocab = start["embed_tokens.weight"].shape[0]
        ids = torch.randint(0, vocab, (B, T), generator=g)
        targets = torch.randint(0, vocab, (B, T), generator=g)
        mask = torch.rand(B, T, generator=g) < share
        model = load_model(path, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        shadow = Bf16Copy(model) if bf16 else None

        def step() -> float:
            net = shadow.synced() if shadow else model
            if share < 1:
                logits = net(ids, logits_at=mask).logits
                loss = -mm.token_logprobs(logits, targets[mask]).mean()
            else:
                loss = masked_loss(net(ids).logits, targets, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if shadow:
                shadow.grads_to_master()
            opt.step()
            return float(loss.detach())

        times, losses = {False: [], True: []}, {}
        for r in range(args.rounds + 1):                 # round 0 warms both ways up
            for kernels in (False, True) if r % 2 == 0 else (True, False):
                mm.TRAIN_KERNELS = kernels
                model.load_state_dict(start)
                opt.state.clear()
                t0 = time.perf_counter()
                losses[kernels] = step()
                if r:
                    times[kernels].append(time.perf_counter() - t0)
        mm.TRAIN_KERNELS = True
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios.append(med[False] / med[True])
        print(f"{stage}: {B} x {T} tokens, {int(mask.sum()):,} trained: PyTorch's operations "
              f"{med[False]:.2f}s, C++ kernels {med[True]:.2f}s a step (median of "
              f"{args.rounds}); loss {losses[False]:.5f} against {losses[True]:.5f}; "
              f"{ratios[-1]:.2f}x", flush=True)
    print("speed-up (PyTorch's operations / C++ kernels): "
          + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
