"""Weight-only int8 for decode steps: `EngineConfig.quantize = "int8"` (`--quantize int8`).

A decode step of one or a few rows reads every active weight once and does little arithmetic
with it, so on a CPU its cost is the bytes it reads. With `quantize(model, "int8")` (bf16
models) every linear layer a decode step runs (attention's q, k, v and o, the routed experts,
dense MLPs and the output head; those whose input width is a multiple of 16) also holds a
copy of its weight as int8, one scale per output row (absmax / 127, the scale rounded to bf16
first and the ints rounded against it), and matmuls of at most `KERNEL_ROWS` rows (decode
steps, in Python and in the C++ step) run the extension's `int8_rows` on that copy
(csrc/decode.cpp): half the bytes of bf16. The router and the embeddings keep their weights:
a route flipped by rounding changes which experts run, not how well.

What it leaves alone: matmuls of many rows (prefill, scoring) use the full weights, where the
work is arithmetic and int8 saves nothing; the model's parameters and `state_dict` are the
full weights, so checkpoints, training and weight deltas see what they always did, and
`requantize` makes the copies again after the weights change (`EnginePolicy.swap_state`).
Behaviour logprobs are those of the weights that computed each token (the int8 copy for
decoded tokens), which is what the learner must see to correct for them. Each row's output
depends only on that row (the kernel's rows are independent), so a row decodes the same bits
in a batch as alone.
"""

from __future__ import annotations

import torch
from torch import nn

from agent_runtime.model.model import Experts, Linear, MoE, _extension

MODES = ("int8",)
ALIGN = 64            # bytes: the CPU allocator's alignment, what the kernel's loads need


def int8_weight(w: torch.Tensor, dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., N, K], scale [..., N] in `dtype`, default w's) with q * scale ~ w: one
    scale per output row, absmax / 127 rounded to `dtype`, the ints rounded against it."""
    dtype = dtype or w.dtype
    wf = w.detach().float()
    scale = (wf.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)
    q = torch.round(wf / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear(x: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor],
                b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most `KERNEL_ROWS` rows) @ (int8 weight * scale).T (+ b): the C++
    extension's `int8_rows` (the C++ step's too, so the two agree bitwise), or, without a
    compiler, `torch._weight_int8pack_mm`, whose AVX512 kernel reads x's rows with aligned
    loads (a view that does not start on a 64-byte boundary is copied first) and, at these
    sizes, runs at bf16's speed (measured: 1.04x on the 0.5 B test shape)."""
    qw, scale = q
    ext = _extension()
    if ext is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return ext.int8_rows(x, qw, scale, b)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % ALIGN:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    y = torch._weight_int8pack_mm(x2, qw, scale).view(*x.shape[:-1], qw.shape[0])
    return y if b is None else y + b


def quantizable(w: torch.Tensor) -> bool:
    """Whether weight w [..., N, K] gets an int8 copy: K % 16 == 0 (every linear layer of the
    default model and of the common MoE checkpoints), which torch's kernel, the fallback
    without a compiler, needs (it steps through K 16 at a time with no tail); ours does not,
    but the two paths keep one rule so a model gets the same copies either way."""
    return w.shape[-1] % 16 == 0


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Give `model`'s decode-step linear layers an int8 copy of their weights (in place;
    `mode` "int8", the only one). Returns the model."""
    if mode not in MODES:
        raise ValueError(f"quantize: unknown mode {mode!r} (known: {', '.join(MODES)})")
    if model.dtype != torch.bfloat16:       # `int8_rows` takes bf16 rows
        raise ValueError(f"quantize: int8 weights serve bfloat16 models, this one is "
                         f"{str(model.dtype).removeprefix('torch.')} (load it with dtype "
                         f"bfloat16)")
    if model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("quantize: int8 decode runs on the CPU")
    model.quantized = mode
    requantize(model)
    return model


def requantize(model: nn.Module) -> None:
    """Make `model`'s int8 copies again from its weights (after they changed); a no-op for a
    model that is not quantized."""
    if getattr(model, "quantized", None) is None:
        return
    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoE)}
    routers |= {id(m.shared_expert_gate) for m in model.modules()
                if isinstance(m, MoE) and hasattr(m, "shared_expert_gate")}
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear) and id(m) not in routers:
                m.q = int8_weight(m.weight) if quantizable(m.weight) else None
            elif isinstance(m, Experts):
                q = tuple(t for w in (m.gate_up, m.down)
                          for t in (int8_weight(w) if quantizable(w) else (None, None)))
                m.q = q if any(t is not None for t in q) else None
