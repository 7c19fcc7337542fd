"""`generate.sample` with the C++ `sample_rows` against the tensor path it replaces, called as
`generate` calls it (last-position logits [rows, vocab] in the model's dtype, one generator),
in one run, the two paths interleaved round by round.

Prints, per (rows, vocabulary, temperature), the 10th percentile and median of each path's
time over `--calls` calls, and the speed-up of the case a GRPO group decodes with (8 rows of
the default model's 8,192 tokens at temperature 0.6) last.

    python bench/sample.py
    python bench/sample.py --threads 1 --calls 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from agent_runtime.model import generate as gen_mod  # noqa: E402
from agent_runtime.model.fast_decode import extension  # noqa: E402

CASES = [(1, 8192, 0.0), (1, 8192, 0.6), (8, 8192, 0.0), (8, 8192, 0.6), (1, 32768, 0.0),
         (1, 32768, 0.6)]


def times(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if extension() is None:
        sys.exit("the C++ extension did not build here; nothing to compare")
    fused = gen_mod._fused_sampler
    gen = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, {args.calls} calls x {args.rounds} rounds a path, bf16 logits"
          " (microseconds a call: 10th percentile / median)")
    speedup = {}
    for rows, vocab, temp in CASES:
        logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
        p = gen_mod.SamplingParams(temperature=temp)
        got: dict[str, list[float]] = {"fused": [], "tensor": []}
        for _ in range(args.rounds):
            for name in got:
                gen_mod._fused_sampler = fused if name == "fused" else (lambda *a: None)
                got[name] += times(lambda: gen_mod.sample(logits, p, gen), args.calls)
        gen_mod._fused_sampler = fused
        q = {k: (sorted(v)[len(v) // 10], statistics.median(v)) for k, v in got.items()}
        speedup[(rows, vocab, temp)] = q["tensor"][0] / q["fused"][0]
        print(f"rows {rows} vocab {vocab:>6} temperature {temp}: sample_rows "
              f"{q['fused'][0] * 1e6:6.1f} / {q['fused'][1] * 1e6:6.1f}  tensor ops "
              f"{q['tensor'][0] * 1e6:6.1f} / {q['tensor'][1] * 1e6:6.1f}  "
              f"({speedup[(rows, vocab, temp)]:.1f}x)")
    print(f"speed-up, 8 rows of 8,192 at temperature 0.6: {speedup[(8, 8192, 0.6)]:.1f}x")


if __name__ == "__main__":
    main()
