"""Prefill and decode throughput of our engine vs `transformers` on the same MoE checkpoint.

    python bench/decode.py                       # ~0.5 B test shape, fp32 and bf16, 2 threads
    python bench/decode.py --model PATH          # any HF-format MoE checkpoint
    python bench/decode.py --device cuda         # on a GPU
    python bench/decode.py --rows 8              # and 8 rows of one batch against one row
    python bench/decode.py --quantize int8       # and bf16 decode with int8 weight copies

Both engines load the same checkpoint, get the same prompt, decode the same number of greedy
tokens (checked identical), and are timed in the same run. Prints prefill (through `generate`
with one new token, and as a plain forward `model(ids)` with every position's logits, the two
ways a user meets it) and decode tokens/s,
the memory-bandwidth bound of decode (active bytes per token over the memory bandwidth
measured just before and after our decode) and our share of it, that bound again at the
read-only bandwidth alone (a copy also writes; decode only reads), the
matmul bound of prefill (operations per token over the measured speed of one large matmul)
and the ratios ours/transformers; with --rows N, last, our decode tokens/s with N rows of one
batch (a GRPO group: one prompt, rows sampled at temperature 1) against one row sampled alike,
and the most that ratio could be if both read their weights at one bandwidth (N rows read the
union of their experts: measured from their routes) or if the N rows' arithmetic ran at the
large matmul's speed (2 operations per active weight and row, plus attention);
with --quantize int8, last, bf16 decode with int8 copies of the weights (`quantize`) against
bf16, with its own bandwidth bound (fewer bytes a token) and how many greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agent_runtime.model import load_model, save_model
from agent_runtime.model.config import args_from_hf
from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.model.model import UPCAST_CPU, Experts, MoEModel
from agent_runtime.model.quantize import quantize
from agent_runtime.policies import resolve_model_path

TEST_SHAPE = {  # ~0.5 B parameters: hidden 1024, 8 layers, 32 experts top-4, width 512
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32768,
    "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
    "moe_intermediate_size": 512, "intermediate_size": 2048, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "hidden_act": "silu",
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}


def make_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    model = MoEModel(args_from_hf(TEST_SHAPE), TEST_SHAPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) * 0.5 + 0.75 if "norm" in name else torch.randn_like(p) * 0.02)
    save_model(model, path, dtype="bfloat16")
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn):
    """(seconds, fn()) with the device synchronized on both sides."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def memory_bandwidth(device: str) -> float:
    """Bytes per second the memory delivers: the better of a large tensor copy (read + write
    counted) and a large sum (read only, as decode reads its weights), best of 5 each."""
    return max(bandwidths(device))


def bandwidths(device: str) -> tuple[float, float]:
    """(copy, read) bytes per second, best of 5 each: a large tensor copy (read + write
    counted) and a large sum (read only: what decode does with its weights)."""
    x = sum_buffer(device)
    y = torch.empty_like(x)
    copy = min(timed(device, lambda: y.copy_(x))[0] for _ in range(5))
    return 2 * x.nbytes / copy, read_bandwidth(device, x, 5)


def sum_buffer(device: str) -> torch.Tensor:
    """The 256 MB the bandwidth measurements read."""
    return torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=device).uniform_()


def read_bandwidth(device: str, x: torch.Tensor, reps: int) -> float:
    """Bytes per second a sum of `x` reads, best of `reps`."""
    return x.nbytes / min(timed(device, lambda: x.sum())[0] for _ in range(reps))


def matmul_flops(device: str, dtype: torch.dtype) -> float:
    """Floating-point operations per second of a large square matmul in the dtype the engine's
    prefill matmuls run in (fp32 for half-precision weights on CPUs that upcast them)."""
    if device == "cpu" and dtype != torch.float32 and UPCAST_CPU:
        dtype = torch.float32
    n = 1536
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = [timed(device, lambda: torch.mm(a, b))[0] for _ in range(5)]
    return 2 * n ** 3 / min(times[1:])


def decode_flops(model: MoEModel, context: float) -> float:
    """Operations per decoded token of one row: 2 per active weight (its own top_k experts),
    plus attention's scores and values over `context` cached positions."""
    a = model.args
    weights = active_bytes(model) / model.embed_tokens.weight.element_size()
    return 2 * weights + 4 * a.num_layers * a.num_heads * a.head_dim * context


def prefill_flops(model: MoEModel, prompt_len: int) -> float:
    """Operations per prompt token: a decoded token's, attending to half the prompt."""
    return decode_flops(model, prompt_len / 2)


def active_bytes(model: MoEModel) -> int:
    """Weight bytes read to decode one token: everything but the unused experts and embedding."""
    a = model.args
    size = model.embed_tokens.weight.element_size()
    total = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if a.tie_embeddings:
        total += model.embed_tokens.weight.numel()
    expert = 3 * a.hidden_size * a.expert_size
    total -= a.num_moe_layers * (a.num_experts - a.top_k) * expert
    return total * size


def rows_bytes(model: MoEModel, experts: float) -> float:
    """`active_bytes` of a decode step whose rows together route to `experts` experts a layer
    (one row: top_k): a batch of rows reads each routed expert once, but more of them."""
    a = model.args
    expert = 3 * a.hidden_size * a.expert_size * model.embed_tokens.weight.element_size()
    return active_bytes(model) + a.num_moe_layers * (experts - a.top_k) * expert


def int8_active_bytes(model: MoEModel) -> int:
    """`active_bytes` of a model with int8 copies (`quantize`): a weight with a copy is read as
    one byte an entry plus its scales."""
    a = model.args
    size = model.embed_tokens.weight.element_size()
    saved = 0
    for m in model.modules():
        q = getattr(m, "q", None)
        if q is None:
            continue
        if isinstance(m, Experts):                 # only top_k of num_experts are read
            for w, qw in ((m.gate_up, q[0]), (m.down, q[2])):
                if qw is not None:
                    saved += w.numel() * a.top_k // a.num_experts * (size - 1)
        else:
            saved += m.weight.numel() * (size - 1)
    return active_bytes(model) - saved


def time_ours(model, prompt, new, device, reps):
    def run(n):
        t, g = timed(device, lambda: generate(model, [prompt], SamplingParams(max_new_tokens=n))[0])
        return t, g.tokens
    run(4)                                                           # warm-up
    pre = statistics.median(run(1)[0] for _ in range(reps))
    full = [run(new) for _ in range(reps)]
    return pre, statistics.median(t for t, _ in full), full[0][1]


def paired_share(model, prompt, new, device, reps, pre):
    """Median over 2 x reps decodes of each one's tokens/s over the read-only bound measured
    right after it (best of three 256 MB sums): the share at the memory speed of that
    moment. The table's share divides the median decode by the best bandwidth seen around
    all of them, which on a machine whose memory speed swings by 1.5x between seconds sets a
    median against a peak."""
    x, weights = sum_buffer(device), active_bytes(model)
    shares = []
    for _ in range(2 * reps):
        t, _ = timed(device, lambda: generate(model, [prompt], SamplingParams(max_new_tokens=new)))
        shares.append((new - 1) / (t - pre) / (read_bandwidth(device, x, 3) / weights))
    return statistics.median(shares)


def time_forward(model, prompt, device, reps):
    """Seconds of one plain forward over the prompt (`model(ids)`, every position's logits),
    the way a user scores a prompt with either engine: no cache, no generate."""
    ids = torch.tensor([prompt], device=device)

    def run():
        with torch.inference_mode():
            return timed(device, lambda: model(ids))[0]
    run()                                                            # warm-up
    return statistics.median(run() for _ in range(reps))


def time_rows(model, prompt, new, device, reps, rows):
    """Decode tokens/s of `rows` sampled rows of one prompt in one batch (all rows' tokens),
    and the experts a decode step of them reads per layer (mean over steps and layers: the
    union of the rows' routes)."""
    def run(n):
        return timed(device, lambda: generate(
            model, [prompt] * rows, SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)))
    run(4)
    pre = statistics.median(run(1)[0] for _ in range(reps))
    full = [run(new) for _ in range(reps)]
    gens = full[0][1]
    steps = min(len(g.tokens) for g in gens) - 1       # decode steps every row took
    fed = torch.stack([g.routes[len(prompt):len(prompt) + steps].long() for g in gens])
    hot = torch.zeros(steps, fed.shape[2], model.args.num_experts, dtype=torch.bool)
    for r in range(rows):                              # fed [rows, steps, L, k]
        hot.scatter_(2, fed[r], True)
    experts = float(hot.sum(-1).float().mean()) if steps > 0 else float(model.args.top_k)
    return rows * (new - 1) / (statistics.median(t for t, _ in full) - pre), experts


def time_hf(model, prompt, new, device, reps):
    ids = torch.tensor([prompt], device=device)

    def run(n):
        with torch.inference_mode():   # eos_token_id=None: never stops early, never masks eos
            t, out = timed(device, lambda: model.generate(ids, max_new_tokens=n, do_sample=False,
                                                          eos_token_id=None))
        return t, out[0, len(prompt):].tolist()
    run(4)
    pre = statistics.median(run(1)[0] for _ in range(reps))
    full = [run(new) for _ in range(reps)]
    return pre, statistics.median(t for t, _ in full), full[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF MoE checkpoint dir or 'default' (the shipped model); "
                    "without it, a random ~0.5 B test shape")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    ap.add_argument("--rows", type=int, default=0,
                    help="also decode this many sampled rows of one batch against one row")
    ap.add_argument("--quantize", choices=["int8"],
                    help="also decode bf16 with int8 copies of the weights (`--quantize int8`)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    tmp = None
    path = resolve_model_path(args.model) if args.model else None
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = make_checkpoint(Path(tmp.name) / "moe")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for dtype in args.dtypes.split(","):
        ours = load_model(path, dtype=dtype, device=args.device)
        ours_args = ours.args
        flops = matmul_flops(args.device, ours.dtype)
        compute = flops / prefill_flops(ours, args.prompt_len)
        before = bandwidths(args.device)         # on both sides: the machine's varies by 2x
        pre, full, toks = time_ours(ours, prompt, args.new_tokens, args.device, args.reps)
        after = bandwidths(args.device)
        bw, read = max(before + after), max(before[1], after[1])
        paired = paired_share(ours, prompt, args.new_tokens, args.device, args.reps, pre)
        fwd = time_forward(ours, prompt, args.device, args.reps)
        row = {"dtype": dtype, "ours_prefill": args.prompt_len / pre,
               "ours_forward": args.prompt_len / fwd,
               "ours_decode": (args.new_tokens - 1) / (full - pre), "bandwidth": bw,
               "bound": bw / active_bytes(ours), "read": read,
               "read_bound": read / active_bytes(ours), "paired": paired, "compute": compute}
        if args.rows:
            one, _ = time_rows(ours, prompt, args.new_tokens, args.device, args.reps, 1)
            many, experts = time_rows(ours, prompt, args.new_tokens, args.device, args.reps,
                                      args.rows)
            row.update(rows_1=one, rows_n=many, rows_experts=experts,
                       rows_bound=args.rows * active_bytes(ours) / rows_bytes(ours, experts),
                       rows_flops=flops, rows_compute=flops / decode_flops(
                           ours, args.prompt_len + args.new_tokens / 2))
        if args.quantize and ours.dtype == torch.bfloat16:
            quantize(ours, args.quantize)
            bw8 = memory_bandwidth(args.device)
            pre8, full8, toks8 = time_ours(ours, prompt, args.new_tokens, args.device, args.reps)
            bw8 = max(bw8, memory_bandwidth(args.device))
            row.update(int8_decode=(args.new_tokens - 1) / (full8 - pre8),
                       int8_bound=bw8 / int8_active_bytes(ours),
                       int8_same=f"{sum(a == b for a, b in zip(toks, toks8))}/{len(toks)}")
        del ours
        if not args.no_hf:
            import transformers
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(args.device).eval()
            hpre, hfull, htoks = time_hf(hf, prompt, args.new_tokens, args.device, args.reps)
            hfwd = time_forward(hf, prompt, args.device, args.reps)
            del hf
            same = sum(a == b for a, b in zip(toks, htoks))
            row.update(hf_prefill=args.prompt_len / hpre, hf_forward=args.prompt_len / hfwd,
                       hf_decode=(args.new_tokens - 1) / (hfull - hpre),
                       same_tokens=f"{same}/{len(toks)}")
        rows.append(row)
    print(f"checkpoint: {path.name}  device: {args.device}  threads: {torch.get_num_threads()}  "
          f"prompt {args.prompt_len}  new {args.new_tokens}  memory bandwidth "
          + " / ".join(f"{r['bandwidth'] / 1e9:.1f}" for r in rows) + " GB/s")
    print(f"{'dtype':9} {'ours prefill':>13} {'hf prefill':>11} {'mm bound':>9} {'ours decode':>12} "
          f"{'hf decode':>10} {'bw bound':>9} {'share':>6} {'same':>6}   (tokens/s)")
    for r in rows:
        print(f"{r['dtype']:9} {r['ours_prefill']:13.1f} {r.get('hf_prefill', float('nan')):11.1f} "
              f"{r['compute']:9.1f} {r['ours_decode']:12.1f} {r.get('hf_decode', float('nan')):10.1f} "
              f"{r['bound']:9.1f} {r['ours_decode'] / r['bound']:6.0%} "
              f"{r.get('same_tokens', '-'):>6}")
    print("mm bound: prefill tokens/s if every matmul ran at the speed of one large square matmul "
          "(active weights x 2 + attention, over measured FLOP/s); bw bound: decode tokens/s if "
          "reading the active weights were the only cost, at the best memory bandwidth measured "
          "just before and after our decode; share: ours decode / bw bound")
    print("the bound read-only (the sum's bandwidth alone, what decode does with its weights): "
          + "  ".join(f"{r['dtype']}: {r['read'] / 1e9:.1f} GB/s, bound {r['read_bound']:.1f}, "
                      f"share {r['ours_decode'] / r['read_bound']:.0%}" for r in rows))
    print("paired share (each of 2 x reps decodes over the read-only bound measured right after "
          "it, median): " + "  ".join(f"{r['dtype']}: {r['paired']:.0%}" for r in rows))
    print("prefill two ways (tokens/s): generate with one new token (the table's 'prefill': "
          "the last position's logits only) and a plain forward, model(ids), every position's "
          "logits: " + "  ".join(
              f"{r['dtype']}: ours {r['ours_prefill']:.1f} / {r['ours_forward']:.1f}"
              + (f", transformers {r['hf_prefill']:.1f} / {r['hf_forward']:.1f}, forward ratio "
                 f"{r['ours_forward'] / r['hf_forward']:.2f}x" if 'hf_forward' in r else "")
              for r in rows))
    if not args.no_hf:
        print("ratios ours/transformers: " + "  ".join(
            f"{r['dtype']}: prefill {r['ours_prefill'] / r['hf_prefill']:.2f}x "
            f"decode {r['ours_decode'] / r['hf_decode']:.2f}x" for r in rows))
    if args.rows:
        print("batched decode, sampled (tokens/s of all rows): " + "  ".join(
            f"{r['dtype']}: rows {args.rows} {r['rows_n']:.1f} / rows 1 {r['rows_1']:.1f} = "
            f"{r['rows_n'] / r['rows_1']:.2f}x (their experts: {r['rows_experts']:.1f} a layer, "
            f"one row's {ours_args.top_k}; at one bandwidth the rows' bytes allow at most "
            f"{r['rows_bound']:.2f}x; at the large matmul's {r['rows_flops'] / 1e9:.1f} GFLOP/s "
            f"their arithmetic allows at most {r['rows_compute']:.0f} tokens/s, "
            f"{r['rows_compute'] / r['rows_1']:.2f}x)" for r in rows))
    if any("int8_decode" in r for r in rows):
        print("int8 weight copies (bf16 decode, tokens/s): " + "  ".join(
            f"int8 {r['int8_decode']:.1f} (bw bound {r['int8_bound']:.1f}, "
            f"{r['int8_decode'] / r['int8_bound']:.0%}; greedy tokens as bf16 {r['int8_same']}) "
            f"/ bf16 {r['ours_decode']:.1f} = {r['int8_decode'] / r['ours_decode']:.2f}x"
            for r in rows if "int8_decode" in r))


if __name__ == "__main__":
    main()
