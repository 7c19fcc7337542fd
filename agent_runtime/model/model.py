"""One plain-PyTorch MoE decoder covering qwen2_moe, qwen3_moe, olmoe, mixtral and granitemoe.

RMSNorm, RoPE, grouped-query attention with a preallocated KV cache, and an MoE block (router +
experts stored fused as 3-D tensors). `MoEModel.forward` returns logits and the routes (top-k
expert ids per token per MoE layer); passing `routes=` replays them (router replay): the experts
are forced while the gate weights are recomputed from the current router logits, so the router
still gets gradient. Loading/saving lives in `checkpoint.py`, sampling in `generate.py`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agent_runtime.model.config import ModelArgs


@dataclass
class ModelOutput:
    logits: torch.Tensor                    # [B, T, V] (T = logits_to_keep when given)
    routes: torch.Tensor | None             # [B, T, L, k] int64 expert ids, L = MoE layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, self.eps)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalize(x) (weight [H], or [W, H]: row i of x takes weight row i % W);
    in bf16 inference, one pass in C++ (the C++ decode step's too, so the two agree bitwise)."""
    ext = _inference_kernels(x, weight)
    if ext is not None:
        return ext.rms_norm_rows(x, weight, eps)
    if _training_kernels(x, weight):
        return NormRows.apply(x, weight, eps)
    return weight * rms_normalize(x, eps)


class NormRows(torch.autograd.Function):
    """`norm` of bf16 x with a gradient: `rms_norm_rows` forward (the inference kernel's bits,
    so a training forward computes its norms as the decode step does) and
    `rms_norm_rows_backward` (fp32, rounded once: not autograd's bits), one pass each where
    PyTorch takes seven operations and their backward (in a GRPO training step of the
    default model, the per-head q/k norms and the block norms took ~15 % of the time)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _extension().rms_norm_rows(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = _extension().rms_norm_rows_backward(grad, x, weight, ctx.eps)
        return dx, dw.to(weight.dtype).view(weight.shape), None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32 and rounded to x's dtype (HF's order)."""
    xf = x.float()
    return (xf * xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


class KVCache:
    """Preallocated keys/values for every layer; all rows share one write position. `dtype` is
    the cache's own (see `cache_dtype`): keys and values are rounded to the model's dtype
    first, so a wider cache holds exactly the model's values."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (batch, args.num_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # key padding
        self.max_len, self.dtype = max_len, dtype
        self.pos = 0                          # columns filled so far
        self.shared = 0                       # columns every row holds the same ...
        self.shared_from: torch.Tensor | None = None  # ... from its column shared_from[b] on

    def share(self, common: int | None = None) -> int:
        """Set and return `shared`: how many columns every row sees and holds the same keys
        and values in (compared byte for byte), each row from the first column it sees on
        (`shared_from`): a group's common prompt, or the system prompt and task its later
        calls share, when its rows were filled alike. `common`: at most this many (the
        caller's longest common prefix of the rows' tokens), checked in one pass. Decode
        steps then read those columns once for all rows (`fast_decode`); dropping rows
        (`keep`) keeps it true, and later steps write after it."""
        self.shared, self.shared_from = 0, None
        B, n = self.valid.shape[0], self.pos
        if B < 2 or not n or not self.k or self.k[0].device.type != "cpu":
            return 0
        valid = self.valid[:, :n]
        if not bool(valid.any(1).all()):
            return 0
        start = valid.long().argmax(1)                     # each row's first column it sees
        cols = torch.arange(n, device=valid.device)
        seen = valid | (cols[None] < start[:, None])
        gap = ~seen
        end = torch.where(gap.any(1), gap.long().argmax(1), n)
        span = int((end - start).min())                    # columns every row sees in a run
        if common is not None:
            span = min(span, common)
        first = start.tolist()
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
        arrays = [t.view(bits[t.element_size()]).numpy() for t in self.k + self.v]

        def same(width: int) -> bool:                     # numpy: ~5x torch.equal's speed
            return all(np.array_equal(a[b, h, first[b]:first[b] + width],
                                      a[0, h, first[0]:first[0] + width])
                       for a in arrays for b in range(1, B) for h in range(a.shape[1]))

        if span > 0 and not same(span):                   # the longest that is: a search
            low, high = 0, span - 1
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if same(mid) else (low, mid - 1)
            span = low
        self.shared = max(span, 0)
        self.shared_from = start if self.shared else None
        return self.shared

    def keep(self, rows: list[int]) -> list[int]:
        """Drop every row not in `rows` (rows that finished while others decode on, so that
        later steps compute and scan only live ones). Moves as few rows as it can: a kept row
        past the new end fills a dropped row's slot. Returns the kept rows' old indices in
        their new order."""
        n, kept = len(rows), set(rows)
        order = list(range(n))
        holes = [j for j in range(n) if j not in kept]
        movers = [j for j in rows if j >= n]
        for hole, src in zip(holes, movers):
            order[hole] = src
        if holes:
            dst, src = torch.tensor(holes), torch.tensor(movers)
            for t in self.k + self.v:
                t[dst, :, :self.pos] = t[src, :, :self.pos]
            self.valid[dst] = self.valid[src]
        self.k = [t[:n] for t in self.k]
        self.v = [t[:n] for t in self.v]
        self.valid = self.valid[:n]
        if self.shared_from is not None:
            self.shared_from = self.shared_from[torch.tensor(order)]
        return order

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


UPCAST_ROWS = 5  # CPU bf16/fp16 matmuls with at least this many rows run in fp32 ...
# ... on CPUs without native half-precision matmul units (AVX2 and older); AVX-512 CPUs
# (AVX512-BF16, AMX) run bf16 GEMMs natively and faster than fp32. On AVX2 a bf16 matmul
# costs about one one-row pass over the weights per row, the fp32 upcast about four plus a
# little per row (1024x1024, 2 cores: 4 rows 424 vs 549 us, 7 rows 774 vs 522 us).
UPCAST_CPU = torch.backends.cpu.get_cpu_capability() not in ("AVX512", "ZVECTOR", "VSX")


KERNEL_ROWS = 8  # CPU bf16 matmuls of at most this many rows (decode) run in csrc/decode.cpp
PACKED = True  # ... and of any number of rows, where the extension packs weights (`packed_weight`)
PACKED_WIDTH = 1024  # ... except a few rows over wider weights, which stream faster unpacked
# (2 rows over 896 x 4864 from memory: 283 us against 364; the same bits either way)
FUSED_EXPERTS = True  # ... and the routed experts of at most that many bf16 rows, in one call
TRAIN_ATTENTION = True  # causal bf16 attention without a KV cache in C++ (`CausalAttention`)
TRAIN_KERNELS = True  # ... and its RMSNorm, rotary embedding and loss (`NormRows`, `Rope`,
# `token_logprobs`)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           q: tuple[torch.Tensor, torch.Tensor] | None = None,
           wp: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CPU in half precision. Matmuls of at most `KERNEL_ROWS` bf16 rows
    (decode steps) run in the C++ extension's few-row kernel, which reads the weights once for
    all rows without oneDNN's per-call setup (a one-row step of the default model 1.5x
    faster); the C++ decode step calls it too, so both agree bitwise (without a compiler,
    F.linear). Where the extension packs weights (AVX512-BF16 without AMX tiles), bf16
    matmuls of any number of rows run on w's packed copy (`packed_weight`; `wp` when the
    caller has it), with the few-row kernel's bits: a prefill computes every product as the
    decode step does, so keys and values are the same bits however a prompt reached the
    cache. Other matmuls over many rows (prefill) upcast to fp32 where CPUs lack native bf16
    FMA, which runs fp32 GEMMs several times faster, and the result (fp32 accumulation,
    rounded once) is what a bf16 GEMM computes anyway. `q`: w's int8 copy (int8 weight, scale;
    `quantize.quantize`), which matmuls of at most `KERNEL_ROWS` rows use instead (the C++
    step too); never with a gradient."""
    if q is not None and 0 < x.numel() <= KERNEL_ROWS * x.shape[-1] \
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        from agent_runtime.model.quantize import int8_linear
        return int8_linear(x, q, b)
    few = 0 < x.numel() <= KERNEL_ROWS * x.shape[-1]
    if PACKED and x.numel() > 0 and not (few and x.shape[-1] > PACKED_WIDTH) \
            and (ext := _inference_kernels(x, w, *(() if b is None else (b,)))) is not None:
        if wp is None:
            wp = packed_weight(w)
        if wp is not None:
            return ext.packed_linear(x, wp, w.shape[0], b)
    if few and (ext := _inference_kernels(x, w)) is not None:
        return ext.rows_linear(x, w, b)
    if UPCAST_CPU and w.dtype in (torch.bfloat16, torch.float16) and w.device.type == "cpu" \
            and x.numel() >= UPCAST_ROWS * x.shape[-1]:
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def _extension():
    from agent_runtime.model.fast_decode import extension    # it imports this module
    return extension()


_PACKED: dict[int, tuple[tuple, torch.Tensor]] = {}   # id(w) -> (w's version, its packed copy)


def packed_weight(w: torch.Tensor) -> torch.Tensor | None:
    """w (bf16 on the CPU, [..., K], its rows flattened) in the layout of the extension's
    `packed_linear`, made once per version of w (an in-place update, such as a delta applied
    to a live policy, makes it again) and dropped with w; None where the extension does not
    pack rows of w's width (not built, no AVX512-BF16, AMX tiles serving, K % 32 != 0)."""
    if not PACKED or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() < 2:
        return None
    ext = _extension()
    if ext is None or not ext.packs(w.shape[-1]):
        return None
    key = (w._version, w.data_ptr(), tuple(w.shape))
    kept = _PACKED.get(id(w))
    if kept is not None and kept[0] == key:
        return kept[1]
    if kept is None:
        weakref.finalize(w, _PACKED.pop, id(w), None)
    packed = ext.pack_weight(w.detach())
    _PACKED[id(w)] = (key, packed)
    return packed


def _inference_kernels(*tensors: torch.Tensor):
    """The C++ extension when every tensor is bf16 on the CPU and none needs a gradient (its
    kernels have no backward), so that it serves the call; else None."""
    if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) \
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return _extension()
    return None


def _whole_sequence_in_cpp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal attention over a whole sequence (no KV cache: a training forward, or
    the trainer's scoring of its reference model) runs in `CausalAttention` (bf16 on the
    CPU, head size % 32 == 0, the C++ extension built with AMX tiles or AVX512-BF16); else
    `scaled_dot_product_attention` and its backward serve, or without a gradient the
    inference kernel."""
    if not (TRAIN_ATTENTION and q.shape[-1] % 32 == 0
            and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k, v))):
        return False
    ext = _extension()
    return ext is not None and ext.has_train_attention()


def _training_kernels(*tensors: torch.Tensor) -> bool:
    """Whether RMSNorm and the rotary embedding of a forward that needs a gradient run in
    `NormRows` and `Rope`: bf16 on the CPU with the C++ extension built."""
    return TRAIN_KERNELS and all(t.dtype == torch.bfloat16 and t.device.type == "cpu"
                                 for t in tensors) and _extension() is not None


class CausalAttention(torch.autograd.Function):
    """`scaled_dot_product_attention(q, k, v, is_causal=True, scale=, enable_gqa=True)` for
    bf16 q [B, H, T, D] and k, v [B, KV, T, D], forward and backward in C++ on AMX tiles, or
    with AVX512-BF16 dot products on CPUs without them (`attention_train` in
    csrc/decode.cpp: flash attention's plan, the log-sum-exp saved and the probabilities
    recomputed). PyTorch's CPU kernel spent ~5x its forward's time in its backward, a third
    of a GRPO training step; the values agree with it to bf16 rounding. `spans` [B, 2]: only
    the query positions [first, end) of row b are computed (the others' outputs are 0 and
    get no gradient): a packed prefix tree's path (`Paths`)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, spans=None):
        out, lse = _extension().attention_train(q, k, v, scale, spans)
        ctx.save_for_backward(q, k, v, out, lse, spans)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, spans = ctx.saved_tensors
        dq, dk, dv = _extension().attention_train_backward(grad, q, k, v, out, lse, ctx.scale,
                                                           spans)
        return dq, dk, dv, None, None


class Rope(torch.autograd.Function):
    """`qk * cos + rotate_half(qk) * sin` for bf16 qk [B, T, N, D] (returned as [B, N, T, D]),
    cos and sin [B, 1, T, D], with a gradient: `rope_rows` forward and `rope_rows_backward`
    in C++, each one pass where PyTorch takes six operations and their backward, and each
    with the Python path's bits (in a GRPO training step of the default model those
    operations took ~10 % of the time)."""

    @staticmethod
    def forward(ctx, qk, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _extension().rope_rows(qk, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _extension().rope_rows_backward(grad, cos, sin), None, None


class TokenLogprobs(torch.autograd.Function):
    """`token_logprobs` in C++: one pass over each row forward and one backward."""

    @staticmethod
    def forward(ctx, logits, target, temps):
        lp, lse = _extension().token_logprobs(logits, target, temps)
        ctx.save_for_backward(logits, target, temps, lse)
        return lp

    @staticmethod
    def backward(ctx, grad):
        logits, target, temps, lse = ctx.saved_tensors
        return _extension().token_logprobs_backward(grad, logits, target, temps, lse), None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor,
                   temps: torch.Tensor | float = 1.0) -> torch.Tensor:
    """log p(target[n]) under softmax(logits[n] / temps[n]), in fp32, for logits [N, V] (bf16
    or fp32): `(logits.float() / temps[:, None]).log_softmax(-1).gather(-1, target[:, None])`
    without its passes over [N, V] in fp32 (a float copy, a division, log_softmax, the gather
    and each one's backward: ~18 % of a GRPO training step of the default model on the CPU).
    The C++ extension computes it on the CPU (its sums in another order: equal to fp32
    rounding, not bitwise); elsewhere PyTorch does."""
    if not torch.is_tensor(temps):
        temps = torch.full((logits.shape[0],), float(temps), device=logits.device)
    if TRAIN_KERNELS and logits.device.type == "cpu" and logits.dim() == 2 \
            and logits.dtype in (torch.bfloat16, torch.float32) and _extension() is not None:
        return TokenLogprobs.apply(logits, target, temps)
    return (logits.float() / temps[:, None]).log_softmax(-1).gather(-1, target[:, None])[:, 0]


def attention_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype attention without a KV cache runs in: the model's, except fp32 for
    half-precision models on CPUs that upcast matmuls (`UPCAST_CPU`), where the CPU attention
    kernels run several times slower in bf16 than in fp32."""
    if UPCAST_CPU and dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a KV cache is kept in: a bf16 model's own on a CPU where the C++ extension is
    built, on every CPU. Decode steps then attend in C++ over half the bytes, and the C++ step
    runs on pointers (`decode_direct`); prompts of more than one token still attend in fp32
    where CPUs upcast (`Attention.forward`). On a 2-core AMD EPYC with AVX2 only, the default
    model decoded one row after a 1,500-token prompt at 1,135-1,658 tokens/s against 574-641
    with an fp32 cache (bench/RESULTS.md, stop 81). Else `attention_dtype`'s."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and _extension() is not None:
        return dtype
    return attention_dtype(dtype, device)


class Linear(nn.Linear):
    q: tuple[torch.Tensor, torch.Tensor] | None = None   # int8 copy (`quantize`), not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.q)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Paths:
    """The root-to-leaf paths of a prefix tree packed into one row (each shared position fed
    once: the trainer's rows that start alike, `learner.trainer`). index [R, L]: the packed
    positions along path r (padded at its end with any position: causal attention keeps a
    path's positions from seeing what follows them); take [T]: for each packed position, its
    place r * L + l in one path that holds it; spans [R, 2] (int64, on the CPU) or None: the
    places [first, end) of path r that `take` reads (a path's own positions follow those it
    shares with earlier paths), the only ones whose attention must be computed. Attention runs
    along each path as on a row of its own; everything else runs once per packed position."""
    index: torch.Tensor
    take: torch.Tensor
    spans: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.a, self.layer = a, layer
        self.q_proj = Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm == "head":
            self.q_norm = RMSNorm(a.head_dim, a.rms_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_eps)
        elif a.qk_norm == "full":
            self.q_norm = RMSNorm(a.num_heads * a.head_dim, a.rms_eps)
            self.k_norm = RMSNorm(a.num_kv_heads * a.head_dim, a.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None, causal: bool,
                paths: Paths | None = None) -> torch.Tensor:
        """x [B, T, H]; cos, sin [B, 1, T, D]; `paths`: x is a packed prefix tree (see
        `Paths`), whose positions attend along their paths."""
        a = self.a
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)          # [B, T, heads*D]
        if a.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        qk = torch.cat((q.view(B, T, a.num_heads, a.head_dim),
                        k.view(B, T, a.num_kv_heads, a.head_dim)), dim=2)  # [B, T, h + kv, D]
        if a.qk_norm == "head":                # per-head norms of q and k in one pass
            w = torch.cat((self.q_norm.weight.expand(a.num_heads, -1),
                           self.k_norm.weight.expand(a.num_kv_heads, -1)))
            qk = norm(qk, w, a.rms_eps)
        v = v.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        ext = _inference_kernels(qk, cos)
        if ext is not None:                    # the same bits in one pass (and the C++ step's)
            qk = ext.rope_rows(qk, cos, sin)                             # [B, h + kv, T, D]
        elif _training_kernels(qk, cos, sin):  # the same, with a gradient (training)
            qk = Rope.apply(qk, cos, sin)
        else:
            qk = qk.transpose(1, 2)                                      # [B, h + kv, T, D]
            qk = qk * cos + rotate_half(qk) * sin                        # one RoPE for q and k
        q, k = qk.split((a.num_heads, a.num_kv_heads), dim=1)
        dtype = cache.dtype if cache is not None else attention_dtype(x.dtype, x.device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)                        # [B, kv, S, D]
        group = a.num_heads // a.num_kv_heads
        if paths is not None:                  # each path's causal attention, as its own row
            R, L = paths.index.shape          # index_select: its backward adds, no sort
            q, k, v = (t[0].index_select(1, paths.index.flatten())
                       .view(t.shape[1], R, L, a.head_dim).transpose(0, 1) for t in (q, k, v))
            if _whole_sequence_in_cpp(q, k, v):   # only the positions a path computes
                out = CausalAttention.apply(q, k, v, a.scale, paths.spans)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scale,
                                                     enable_gqa=group > 1)
            out = out.transpose(1, 2).reshape(-1, a.num_heads * a.head_dim) \
                .index_select(0, paths.take)
            return self.o_proj(out[None].to(x.dtype))                    # [1, T, heads * D]
        if cache is None and mask is None and causal and T > 1 and _whole_sequence_in_cpp(q, k, v):
            out = CausalAttention.apply(q, k, v, a.scale)      # training (and scoring) in bf16
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1).to(x.dtype))
        ext = _inference_kernels(q)   # inference in bf16: row by row in C++ (the C++ decode
        if ext is not None and T > 1 and UPCAST_CPU:   # step's attention too, so the two agree
            # bitwise), except a prompt's rows where CPUs lack bf16 dot products: PyTorch's fp32
            # kernel on the bf16 values, widened exactly, is faster there (AVX2, a causal prompt
            # of 1,024 tokens: 5.8 ms against 7.0; 1,500: 11.6 against 21.3)
            q, k, v, ext = q.float(), k.float(), v.float(), None
        if ext is not None:
            out = ext.attention_rows(q.reshape(B, a.num_kv_heads, group, T, a.head_dim),
                                     k, v, mask, causal, a.scale)
            out = out.reshape(B, a.num_heads, T, a.head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1).to(x.dtype))
        if T == 1 and group > 1:
            # Decode: the heads sharing a kv head become that head's queries, so keys and
            # values are read once instead of expanded per head (2x faster on CPU at 1.7k).
            out = F.scaled_dot_product_attention(q.reshape(B, a.num_kv_heads, group, a.head_dim),
                                                 k, v, attn_mask=mask, scale=a.scale)
            return self.o_proj(out.reshape(B, 1, -1).to(x.dtype))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=a.scale, enable_gqa=group > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """All routed experts of one layer as fused tensors: gate_up [E, 2I, H], down [E, H, I]."""
    q: tuple[torch.Tensor, ...] | None = None   # int8 copies (`quantize`): gate_up's weight
                                                # and scale, then down's; not state

    def __init__(self, a: ModelArgs):
        super().__init__()
        E, H, I = a.num_experts, a.hidden_size, a.expert_size
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))

    def packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """gate_up and down packed for `packed_linear` ([E * 2I, H] and [E * H, I], each
        expert's rows a whole number of blocks of 16), or None (see `packed_weight`)."""
        if self.gate_up.shape[1] % 16 or self.down.shape[1] % 16:
            return None
        gp, dp = packed_weight(self.gate_up), packed_weight(self.down)
        return None if gp is None or dp is None else (gp, dp)

    def _one(self, x: torch.Tensor, e: int, q: tuple[torch.Tensor, ...] | None = None
             ) -> torch.Tensor:
        if q is None:
            pk = None if torch.is_grad_enabled() and self.gate_up.requires_grad \
                else self.packed()
            if pk is not None:
                g, d = pk[0].numel() // self.gate_up.shape[0], pk[1].numel() // self.down.shape[0]
                return self._mlp(x, self.gate_up[e], self.down[e],
                                 gate_up_p=pk[0][e * g:(e + 1) * g],
                                 down_p=pk[1][e * d:(e + 1) * d])
            return self._mlp(x, self.gate_up[e], self.down[e])
        gq, gs, dq, ds = q                               # None: that weight has no copy
        return self._mlp(x, self.gate_up[e], self.down[e],
                         None if gq is None else (gq[e], gs[e]),
                         None if dq is None else (dq[e], ds[e]))

    @staticmethod
    def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             gate_up_q: tuple | None = None, down_q: tuple | None = None,
             gate_up_p: torch.Tensor | None = None, down_p: torch.Tensor | None = None
             ) -> torch.Tensor:
        g, u = linear(x, gate_up, q=gate_up_q, wp=gate_up_p).chunk(2, dim=-1)  # [n, I] each
        return linear(F.silu(g) * u, down, q=down_q, wp=down_p)                # [n, H]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        N, k = idx.shape                                                 # x [N, H]
        # the int8 copies serve a decode step's rows (`linear`'s rule, by the rows of the
        # whole step, not of one expert's share of a prefill)
        q = self.q if N <= KERNEL_ROWS and not (torch.is_grad_enabled()
                                                and self.gate_up.requires_grad) else None
        if FUSED_EXPERTS and q is not None and q[0] is not None and q[2] is not None \
                and (ext := _inference_kernels(x)) is not None:
            # decode with int8 copies of both weights: one call, bitwise the loops below
            return ext.moe_rows_i8(x, idx, w, *q)
        if FUSED_EXPERTS and N <= KERNEL_ROWS and self.q is None \
                and (ext := _inference_kernels(x, self.gate_up, self.down)) is not None:
            # decode: all chosen experts in one call, bitwise the loops below
            return ext.moe_rows(x, idx, w, self.gate_up, self.down)
        if N == 1:                                                       # decode: k small matmuls
            # summed as the lines below sum a row's experts (index_add_: in fp32 from +0, in
            # ascending expert order, rounded once), so a token decoded alone gets the bits
            # it gets in a prefill
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e, we in sorted(zip(idx.tolist()[0], w.tolist()[0])):
                out += (self._one(x, e, q) * we).float()
            return out.to(x.dtype)
        flat = idx.reshape(-1)                                           # [N*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        token = order // k                                               # source token per slot
        xs = x[token]                                                    # [N*k, H]
        if torch.is_grad_enabled() and self.gate_up.requires_grad:
            # Training: per-expert views from one unbind, one split and one cat. Indexing the
            # fused parameter or the token rows per expert (or writing slices of one output)
            # would make every expert's backward allocate, zero and copy a tensor the size of
            # all experts (or of all rows): 60 % of a training step's time on CPU.
            gate_up, down = self.gate_up.unbind(0), self.down.unbind(0)
            ys = torch.cat([self._mlp(rows, gate_up[e], down[e])
                            for e, rows in enumerate(xs.split(counts)) if counts[e]])
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    ys[start:start + n] = self._one(xs[start:start + n], e, q)
                    start += n
        ys = ys * w.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))  # autocast: ys bf16


class MoE(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.gate = Linear(a.hidden_size, a.num_experts, bias=False)     # the router
        self.experts = Experts(a)
        if a.shared_expert_size:
            self.shared_expert = MLP(a.hidden_size, a.shared_expert_size)
            self.shared_expert_gate = Linear(a.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, routes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [N, k] and gate weights [N, k]; `routes` forces the ids (replay)."""
        a = self.a
        logits = self.gate(x).float()                                    # [N, E]
        if a.router_mode == "softmax_topk":
            probs = logits.softmax(-1)
            if routes is None:
                w, idx = probs.topk(a.top_k, dim=-1)
            else:
                idx = routes
                w = probs.gather(-1, idx)
            if a.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
        else:                                                            # top-k, then softmax
            if routes is None:
                top, idx = logits.topk(a.top_k, dim=-1)
            else:
                idx = routes
                top = logits.gather(-1, idx)
            w = top.softmax(-1)
        return idx, w.to(x.dtype)

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        idx, w = self.route(flat, None if routes is None else routes.reshape(-1, self.a.top_k))
        out = self.experts(flat, idx, w)
        if self.a.shared_expert_size:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(B, T, H), idx.view(B, T, -1)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.a = a
        self.is_moe = a.moe_layers[layer]
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_eps)
        self.self_attn = Attention(a, layer)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_eps)
        self.mlp = MoE(a) if self.is_moe else MLP(a.hidden_size, a.dense_size)

    def forward(self, x, cos, sin, cache, mask, causal, routes, paths=None):
        m = self.a.residual_multiplier
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, causal, paths)
        x = x + h * m if m != 1.0 else x + h
        h = self.post_attention_layernorm(x)
        idx = None
        if self.is_moe:
            h, idx = self.mlp(h, routes)
        else:
            h = self.mlp(h)
        x = x + h * m if m != 1.0 else x + h
        return x, idx


def rope_frequencies(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [D/2] in fp32, as `transformers` computes them.

    A bf16 copy of them is off by up to 0.4 %: for the default model's shape, a rotary pair's
    angle between tokens 4,095 positions apart is then wrong by up to 0.73 radians (0.18 at
    1,000). `.to(torch.bfloat16)` of a whole model rounds the `inv_freq` buffer with the
    weights, so tables built from it (a bf16 training copy's, before this function) train the
    model on relative positions that serving it, and transformers, never show it."""
    D = args.head_dim
    return 1.0 / (args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float, device=device) / D))


class MoEModel(nn.Module):
    def __init__(self, args: ModelArgs, hf_config: dict | None = None):
        super().__init__()
        self.args = args
        self.hf_config = dict(hf_config or {})
        # built on "meta" to be loaded into (`load_model`), the values are replaced, and a meta
        # tensor's normal_ or arange imports torch._dynamo (~3 s of every model load): skip them
        on_meta = torch.get_default_device().type == "meta"
        weight = torch.empty(args.vocab_size, args.hidden_size)
        if not on_meta:
            nn.init.normal_(weight)                   # what nn.Embedding's own init does
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        freqs = torch.empty(args.head_dim // 2) if on_meta else rope_frequencies(args)
        self.register_buffer("inv_freq", freqs, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        device = self.embed_tokens.weight.device
        return KVCache(self.args, batch, max_len, cache_dtype(self.dtype, device), device)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] for these positions, from a table built once per dtype/device.
        The frequencies are computed again in fp32 (`rope_frequencies`), not read from the
        `inv_freq` buffer, which `model.to(torch.bfloat16)` rounds with the weights."""
        device = self.inv_freq.device
        key = (dtype, device)
        if getattr(self, "_rope_key", None) != key:
            pos = torch.arange(self.args.max_position, device=device).float()
            freqs = pos[:, None] * rope_frequencies(self.args, device)    # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_table = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._rope_key = key
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def forward(self, input_ids: torch.Tensor, routes: torch.Tensor | None = None, *,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                logits_at: torch.Tensor | None = None, paths: Paths | None = None
                ) -> ModelOutput:
        """input_ids [B, T]; routes [B, T, L, k] replays expert choices; attention_mask [B, T]
        marks real tokens (False = left padding) of this call; logits_to_keep=n keeps the last n;
        logits_at [B, T] bool computes logits only there: .logits is then [N, V] (training on a
        few positions of long sequences skips most of the output head); `paths` (with
        `positions`, no cache): input_ids [1, T] is a packed prefix tree (`Paths`)."""
        a = self.args
        B, T = input_ids.shape
        past = cache.pos if cache is not None else 0
        if paths is not None:
            if cache is not None or positions is None or attention_mask is not None or B != 1:
                raise ValueError("a packed tree is one row with its positions and no cache")
            if int(positions.max()) >= a.max_position:
                raise ValueError(f"{int(positions.max()) + 1} tokens exceed the context window "
                                 f"({a.max_position})")
        over = past + T > a.max_position and paths is None   # columns past the window: left-
        if over and cache is None:             # padded rows' positions may still fit (below)
            raise ValueError(f"{past + T} tokens exceed the context window ({a.max_position})")
        if cache is not None and past + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {past + T} tokens > cache length {cache.max_len}")
        valid = attention_mask.bool() if attention_mask is not None else None
        if cache is not None:
            if valid is None and past and not bool(cache.valid[:, :past].all()):
                valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # padded rows
            cache.valid[:, past:past + T] = True if valid is None else valid
        if positions is None:                  # left padding shifts each row's positions
            if valid is None:
                positions = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
            elif cache is not None:
                positions = cache.valid[:, :past + T].long().cumsum(-1)[:, past:] - 1
            else:
                positions = valid.long().cumsum(-1) - 1
            positions = positions.clamp(min=0)
        if over and (valid is None or int(positions.max()) >= a.max_position):
            raise ValueError(f"{int(positions.max()) + 1} tokens exceed the context window "
                             f"({a.max_position})")
        mask, causal = self._mask(B, T, past, valid, cache, input_ids.device)

        x = self.embed_tokens(input_ids)
        if a.embedding_multiplier != 1.0:
            x = x * a.embedding_multiplier
        cos, sin = (t.unsqueeze(1) for t in self._rope(positions, x.dtype))   # [B, 1, T, D]
        all_routes = []
        j = 0
        for block in self.layers:
            r = None
            if block.is_moe and routes is not None:
                r = routes[:, :, j]
            x, idx = block(x, cos, sin, cache, mask, causal, r, paths)
            if idx is not None:
                all_routes.append(idx)
                j += 1
        if cache is not None:
            cache.pos = past + T
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if logits_at is not None:
            x = x[logits_at]                                              # [N, H]
        logits = self.lm_head(self.norm(x))
        if a.logits_scaling != 1.0:
            logits = logits / a.logits_scaling
        out_routes = torch.stack(all_routes, dim=2) if all_routes else None  # [B, T, L, k]
        return ModelOutput(logits=logits, routes=out_routes)

    @staticmethod
    def _mask(B, T, past, valid, cache, device) -> tuple[torch.Tensor | None, bool]:
        """Boolean attention mask [B, 1, T, S] or None with an is_causal flag."""
        if valid is None and cache is None:
            return None, T > 1
        if valid is None and (T == 1 or past == 0):
            return None, T > 1
        S = past + T
        key_valid = cache.valid[:, :S] if cache is not None else valid
        q_pos = torch.arange(past, S, device=device)
        k_pos = torch.arange(S, device=device)
        causal = k_pos[None, :] <= q_pos[:, None]                         # [T, S]
        diag = k_pos[None, :] == q_pos[:, None]                           # keep pad rows finite
        mask = (causal[None] & key_valid[:, None, :]) | diag[None]        # [B, T, S]
        return mask[:, None], False
