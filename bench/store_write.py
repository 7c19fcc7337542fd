"""Write throughput of the session store: add_message and add_sample rows per second.

Each call is its own committed transaction, as in the agent loop. Samples use realistic sizes
(prompt and completion lengths, routes [T, layers, top_k]). Not a test; run it by hand:

    python bench/store_write.py [--n 2000] [--prompt 2048] [--completion 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from agent_runtime.store import SessionStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="rows per measurement")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per sample")
    ap.add_argument("--completion", type=int, default=256, help="completion tokens per sample")
    ap.add_argument("--layers", type=int, default=24, help="MoE layers in the routes")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token in the routes")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (>256: int16)")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, args.prompt).tolist()
    completion = rng.integers(0, 150_000, args.completion).tolist()
    logprobs = (-rng.random(args.completion)).tolist()
    routes = rng.integers(0, args.experts, (args.completion, args.layers, args.top_k))

    with tempfile.TemporaryDirectory() as home, SessionStore(home) as store:
        sid = store.create_session("bench", home, "bench")
        content = "x" * 500
        t0 = time.perf_counter()
        for _ in range(args.n):
            store.add_message(sid, 0, "assistant", content)
        dt = time.perf_counter() - t0
        print(f"add_message: {args.n / dt:,.0f} rows/s ({dt / args.n * 1e3:.3f} ms/row)")

        t0 = time.perf_counter()
        for _ in range(args.n):
            store.add_sample(sid, 0, None, prompt, completion, logprobs, routes, 0)
        dt = time.perf_counter() - t0
        size = store.db.execute("SELECT AVG(length(prompt_ids) + length(completion_ids) + "
                                "length(logprobs) + length(routes)) FROM samples").fetchone()[0]
        print(f"add_sample:  {args.n / dt:,.0f} rows/s ({dt / args.n * 1e3:.3f} ms/row, "
              f"{size / 1024:.1f} KiB of blobs per sample)")


if __name__ == "__main__":
    main()
