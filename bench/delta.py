"""Delta codec benchmark: compression ratio and throughput on learner-like updates.

Synthetic mode (default): a random MoE-shaped parameter set in fp32 master weights takes real
`torch.optim.AdamW` steps on a random loss; the bf16 states published before and after one
step are delta-encoded. Store mode (`--store DIR`): consecutive versions of a real version
store (what the GRPO learner publishes).

Prints, per update: changed fraction, full size, the zstd(full) and zstd(XOR) baselines,
encode and decode throughput (MB of full state per second), and the ratio full/delta last.

    python bench/delta.py                      # ~60M parameters, lr 1e-6, 3e-6, 1e-5
    python bench/delta.py --preset 0.5b        # ~0.47B parameters (about 12 GB of RAM)
    python bench/delta.py --store ~/.apprentice/versions --last 5
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from agent_runtime import delta


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
    full = sum(t.numel() * t.element_size() for t in new.values())
    a, b = concat_words(old), concat_words(new)
    z = zstandard.ZstdCompressor(level=level, threads=-1)
    zfull, zxor = len(z.compress(b)), len(z.compress(a ^ b))
    changed = float(np.count_nonzero(a != b)) / a.size
    del a, b
    t0 = time.perf_counter()
    blob = delta.encode(old, new, level=level)
    t1 = time.perf_counter()
    out = delta.apply(old, blob)
    t2 = time.perf_counter()
    assert delta.state_sha256(out) == delta.state_sha256(new), "round trip failed"
    digests = delta.tensor_digests(old)
    target = {k: v.clone() for k, v in old.items()}
    t3 = time.perf_counter()
    delta.apply_(target, blob, digests=digests)      # the runtime path: cached base digests
    t4 = time.perf_counter()
    mb = full / 1e6
    return {"update": label, "changed": f"{changed:.2%}", "full MB": f"{mb:.0f}",
            "zstd(full)": f"{full / zfull:.2f}x", "zstd(xor)": f"{full / zxor:.1f}x",
            "delta MB": f"{len(blob) / 1e6:.2f}", "encode MB/s": f"{mb / (t1 - t0):.0f}",
            "apply MB/s": f"{mb / (t2 - t1):.0f}", "apply_ MB/s": f"{mb / (t4 - t3):.0f}",
            "ratio": f"{full / len(blob):.1f}x"}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    parser.add_argument("--level", type=int, default=delta.ZSTD_LEVEL, help="zstd level")
    parser.add_argument("--store", help="bench consecutive versions of this version store")
    parser.add_argument("--last", type=int, default=3, help="with --store: how many updates")
    args = parser.parse_args()
    if args.store:
        updates = store_updates(args.store, args.last)
    else:
        shape = PRESETS[args.preset]
        updates = ((f"AdamW lr={lr:g}", *adamw_updates(moe_parameters(shape), lr)) for lr in args.lr)
        print(f"# synthetic {args.preset}: {shape}", flush=True)
    rows = []
    for label, old, new in updates:
        rows.append(measure(label, old, new, args.level))
    print(f"# {sum(t.numel() for t in new.values()) / 1e6:.0f}M parameters, "
          f"{os.cpu_count()} cores, zstd level {args.level}")
    print_table(rows)


if __name__ == "__main__":
    main()
