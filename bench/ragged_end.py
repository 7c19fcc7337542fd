"""A batch whose rows end at different times: ended rows dropped from the cache vs kept.

    python bench/ragged_end.py                   # the shipped model, 8 rows, 1,500-token prompts
    python bench/ragged_end.py --model PATH --rows 8 --prompt-len 1500 --longest 256

How agents share the engine (`BatchingPolicy`, a GRPO group, `apprentice eval -j 8`): the rows
of one batch end at different times, one after a 30-token tool call, another after a 300-token
edit. Before 2026-11-29 an ended row stayed in the batch to its end: every later step still
computed it and scanned its keys and values. Now it leaves (`generate.DROP_ENDED`).

Each of `--rows` rows has its own prompt of `--prompt-len` tokens and ends after its own share
of `--longest` greedy tokens (row i after (i + 1) / rows of it). Both settings decode the same
batch, interleaved, `--reps` times each; the tokens must agree. Prints the median seconds of
each and, last, the ratio kept / dropped (how much faster the batch ends).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agent_runtime.model import generate as gen_module, load_model
from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.policies import resolve_model_path


def run(model, prompts, ends, drop: bool) -> tuple[float, list[list[int]]]:
    gen_module.DROP_ENDED = drop
    counts = [0] * len(prompts)

    def count(row, token, logprob):
        counts[row] += 1

    stops = [lambda i=i: counts[i] >= ends[i] for i in range(len(prompts))]
    t0 = time.perf_counter()
    out = generate(model, prompts, SamplingParams(max_new_tokens=max(ends) + 1, loop_span=0),
                   on_token=count, row_should_stop=stops)
    return time.perf_counter() - t0, [g.tokens for g in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--longest", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(resolve_model_path(a.model))
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.rows)]
    ends = [max(1, a.longest * (i + 1) // a.rows) for i in range(a.rows)]
    run(model, [p[:64] for p in prompts], [4] * a.rows, True)           # warm-up
    times = {True: [], False: []}
    tokens = {}
    for _ in range(a.reps):
        for drop in (False, True):
            t, toks = run(model, prompts, ends, drop)
            times[drop].append(t)
            tokens.setdefault(drop, toks)
    gen_module.DROP_ENDED = True
    if tokens[True] != tokens[False]:
        raise SystemExit("the two settings decoded different tokens")
    kept, dropped = statistics.median(times[False]), statistics.median(times[True])
    total = sum(ends)
    print(f"{a.rows} rows, prompts {a.prompt_len} tokens, rows end after {ends} tokens "
          f"({total} in all), {a.threads} threads, median of {a.reps}")
    print(f"ended rows kept:    {kept:.2f} s  ({total / kept:.1f} tokens/s)")
    print(f"ended rows dropped: {dropped:.2f} s  ({total / dropped:.1f} tokens/s)")
    print(f"dropped vs kept: {kept / dropped:.2f}x")


if __name__ == "__main__":
    main()
