"""Causal attention for training in C++ (`CausalAttention`: AMX tiles, or AVX512-BF16 dot
products on CPUs without them) against PyTorch's
`scaled_dot_product_attention`, the way the trainers call it, in one run.

Two measurements, settings interleaved: (1) the attention alone, forward and backward, bf16
q [1, 4, S, 64] and k, v [1, 2, S, 64] (the default model's heads) at several lengths;
(2) a training step of the default model's bf16 copy (forward with the output head at 30 %
of the positions, as the SFT and GRPO trainers run it, and backward) on ROWS x T tokens, with
`model.TRAIN_ATTENTION` on and off. Prints each time, and the step's speed-up last.

    python bench/train_attention.py                       # 1 thread (the GRPO trainer's)
    python bench/train_attention.py --threads 2 --rows 4 --length 1024   # an SFT step
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def attention_alone(lengths: list[int], rounds: int) -> None:
    import torch
    import torch.nn.functional as F

    from agent_runtime.model.model import CausalAttention

    def timed(fn, q, k, v, grad):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        t0 = time.perf_counter()
        out = fn(*leaves)
        t1 = time.perf_counter()
        out.backward(grad)
        return t1 - t0, time.perf_counter() - t1

    ways = {"tiles": lambda q, k, v: CausalAttention.apply(q, k, v, 0.125),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=0.125, enable_gqa=True)}
    for S in lengths:
        g = torch.Generator().manual_seed(S)
        q, k, v, grad = (torch.randn(1, h, S, 64, generator=g).bfloat16() for h in (4, 2, 2, 4))
        got = {name: [] for name in ways}
        for fn in ways.values():                         # warm: first-call setup untimed
            timed(fn, q, k, v, grad)
        for r in range(rounds):
            for name in (ways if r % 2 == 0 else reversed(list(ways))):
                got[name].append(timed(ways[name], q, k, v, grad))
        line = []
        for name, runs in got.items():
            fwd = statistics.median(t[0] for t in runs) * 1e3
            bwd = statistics.median(t[1] for t in runs) * 1e3
            line.append(f"{name} forward {fwd:.1f} ms, backward {bwd:.1f} ms")
        print(f"S={S}: " + "; ".join(line), flush=True)


def training_step(rows: int, length: int, rounds: int) -> float:
    import torch

    from agent_runtime.model import load_model
    from agent_runtime.model import model as mm
    from agent_runtime.policies.base import resolve_model_path

    work = copy.deepcopy(load_model(resolve_model_path("default"), dtype=torch.float32))
    work = work.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, work.args.vocab_size, (rows, length), generator=g)
    scored = torch.rand(rows, length, generator=g) < 0.3

    def step() -> float:
        work.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = work(ids, logits_at=scored)
        out.logits.float().logsumexp(-1).mean().backward()
        return time.perf_counter() - t0

    times = {True: [], False: []}
    try:
        for on in (True, False):                         # warm: first-call setup untimed
            mm.TRAIN_ATTENTION = on
            step()
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                mm.TRAIN_ATTENTION = on
                times[on].append(step())
                print(f"round {r + 1} {'tiles' if on else 'sdpa':>5}: {times[on][-1]:.2f} s",
                      flush=True)
    finally:
        mm.TRAIN_ATTENTION = True
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"step of {rows} x {length} tokens: sdpa {med[False]:.2f} s, tiles {med[True]:.2f} s")
    return med[False] / med[True]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--lengths", default="1024,2048,3072", help="attention alone: S values")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)

    import torch

    from agent_runtime.model import fast_decode
    ext = fast_decode.extension()
    if ext is None or not ext.has_train_attention():
        sys.exit("it does not serve here: no C++ extension, or neither AMX-BF16 nor AVX512-BF16")
    torch.set_num_threads(args.threads)
    attention_alone([int(s) for s in args.lengths.split(",")], args.rounds)
    ratio = training_step(args.rows, args.length, args.rounds)
    print(f"speed-up of the training step (sdpa / tiles): {ratio:.2f}x")


if __name__ == "__main__":
    main()
