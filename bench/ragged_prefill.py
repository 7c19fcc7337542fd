"""Agent calls prefilled side by side: one padded forward vs groups of like width.

    python bench/ragged_prefill.py                   # the shipped model, the logged batches
    python bench/ragged_prefill.py --model PATH --threads 2 --reps 3

When several agents share the engine (`BatchingPolicy`, `apprentice eval -j 8`, a GRPO
worker's group after its first call), each call reuses its own conversation's keys and values
(the prefix cache) and feeds what is new: one row a 500-token file it read, the next a
30-token tool result, a resumed row (continuous batching) one token. One padded forward
computes every row at the longest row's width, over every row's longest cached span. Since
2026-12-01 the rows prefill in groups of like width instead, cut where padding and the cost
of a forward (`generate.FORWARD_TOKENS`) add up least (`generate.prefill_groups`).

`BATCHES` are eight batches logged from `apprentice eval --model default --tasks sim-heldout
-n 24 -j 8` (2026-12-01): each row's cached and fed token counts. For each, a prefix cache
holding every row's cached tokens (random ids), then `generate` with one new token: the
prefill and a single sampled step. Both settings run each batch `--reps` times, interleaved;
prints the median seconds of each over all batches and, last, the ratio padded / grouped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agent_runtime.model import generate as gen_module, load_model
from agent_runtime.model.generate import FORWARD_TOKENS, SamplingParams, generate
from agent_runtime.model.prefix_cache import PrefixCache
from agent_runtime.policies import resolve_model_path

# (cached, fed) per row
BATCHES = [
    ([246] * 8, [89, 53, 44, 42, 76, 49, 66, 50]),
    ([371, 358, 332, 317, 328, 334, 347, 326], [1, 1, 1, 68, 32, 61, 29, 30]),
    ([420, 395, 430, 364, 393, 339, 391, 411], [1, 1, 1, 299, 350, 102, 275, 224]),
    ([467, 702, 671, 421, 396, 695, 476, 779], [1, 1, 1, 390, 220, 353, 30, 577]),
    ([858, 663, 1095, 1403, 679, 477, 552, 750], [1, 1, 1, 1, 533, 26, 107, 34]),
    ([1445, 1253, 700, 694, 891, 1136], [1, 1, 1, 33, 34, 34]),
    ([1492, 1300, 773, 538, 825, 1207, 747], [1, 1, 1, 42, 26, 33, 33]),
    ([1539, 626, 1286, 966, 1316, 795, 818], [1, 1, 1, 516, 34, 24, 26]),
]


def warm(model, heads: list[list[int]]) -> list:
    """Prefix-cache entries holding each head (a call of one new token stores its prompt)."""
    cache = PrefixCache(1 << 32)
    for h in heads:
        generate(model, [h], SamplingParams(max_new_tokens=1), prefix_cache=cache)
    return list(cache.entries)


def run(model, prompts, entries, grouped: bool) -> tuple[float, list[int]]:
    gen_module.FORWARD_TOKENS = FORWARD_TOKENS if grouped else 1 << 30   # else one forward
    cache = PrefixCache(1 << 32)
    for e in entries:
        cache.add(e)
    t0 = time.perf_counter()
    out = generate(model, prompts, SamplingParams(max_new_tokens=1), prefix_cache=cache)
    return time.perf_counter() - t0, [g.tokens[0] for g in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(resolve_model_path(a.model))
    g = torch.Generator().manual_seed(0)
    cases = []
    for cached, fed in BATCHES:
        heads = [torch.randint(0, model.args.vocab_size, (c,), generator=g).tolist()
                 for c in cached]
        prompts = [h + torch.randint(0, model.args.vocab_size, (f,), generator=g).tolist()
                   for h, f in zip(heads, fed)]
        cases.append((prompts, warm(model, heads)))
    run(model, *cases[0], True)                                          # warm-up
    run(model, *cases[0], False)
    times = {True: [], False: []}
    differ = 0
    for prompts, entries in cases:
        got = {True: [], False: []}
        for _ in range(a.reps):
            for grouped in (False, True):
                t, toks = run(model, prompts, entries, grouped)
                got[grouped].append(t)
                if grouped:
                    differ += toks != first
                else:
                    first = toks
        for grouped in (False, True):
            times[grouped].append(statistics.median(got[grouped]))
    padded, grouped_s = sum(times[False]), sum(times[True])
    print(f"{len(cases)} batches, {sum(len(p) for p, _ in cases)} calls; model {a.model}, "
          f"{a.threads} threads, medians of {a.reps}")
    for i, (t0, t1) in enumerate(zip(times[False], times[True])):
        print(f"  batch {i}: padded {t0 * 1e3:7.1f} ms   grouped {t1 * 1e3:7.1f} ms")
    print(f"first tokens that differ between the two: {differ} of "
          f"{a.reps * sum(len(p) for p, _ in cases)}")
    print(f"padded {padded:.3f} s, grouped {grouped_s:.3f} s; padded / grouped: "
          f"{padded / grouped_s:.2f}x")


if __name__ == "__main__":
    main()
