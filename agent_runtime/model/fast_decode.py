"""One-token decode steps in C++: the same ATen operations as `MoEModel.forward`, without the
interpreter between them.

A one-token step of a small MoE on a CPU is ~70 small operations per layer; in eager PyTorch
each costs microseconds of Python and dispatch, far more than the arithmetic (the default model
reads ~5 MB of active weights a token). `csrc/decode.cpp` issues the same operations with the
same arguments from C++, so its logits and routes are bitwise the Python path's. It is built
once per machine with `torch.utils.cpp_extension` (cached under the torch extensions folder)
the first time a decode needs it; when it cannot be built (no compiler, no ninja) or the model
is of a kind it does not cover, `stepper` returns None and generation stays in Python.
A model with int8 copies of its weights (`quantize`) passes them too, and the step's matmuls of
at most 8 rows run on them, as `model.linear` does.
For a bf16 model without biases, with int8 copies of every weight `quantize` copies or of
none, the step runs on pointers instead (`decode_direct`: the same kernels on the same values,
so the same bits, without the tensor operations between them; `APPRENTICE_DECODE_DIRECT=0`,
read by each `stepper` call, keeps the tensor step).
`APPRENTICE_FAST_DECODE=0` turns the step off, not the extension's few-row bf16 matmul
(`rows_linear`), which `model.linear` uses whenever the extension is built, so that the Python
step and the C++ one compute the same bits. On CPUs with AMX-BF16 tiles the few-row products
run on them (`amx_range`), for every row count; `APPRENTICE_AMX=0` (read once a process) keeps
them on the AVX512 loop.

It does not prefill, sample or manage caches (`generate` does) and never trains.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from agent_runtime.model.model import (PACKED_WIDTH, UPCAST_CPU, KVCache, ModelOutput, MoEModel,
                                       packed_weight)

log = logging.getLogger(__name__)
ENV = "APPRENTICE_FAST_DECODE"
DIRECT = "APPRENTICE_DECODE_DIRECT"   # "0": the step's tensor operations, not its pointer path
SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"

_lock = threading.Lock()
_ext: Any = None
_failed: str | None = None


def extension() -> Any:
    """The compiled module, building it on first use; None when it cannot be built."""
    global _ext, _failed
    if _ext is not None or _failed is not None:    # built (or failed) once: no lock, as
        return _ext                                # `model.linear` asks on every decode matmul
    with _lock:
        if _ext is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load
                # -march=native: the few-row matmul kernel vectorizes for this CPU; the name
                # keeps builds for different CPU capabilities apart in a shared cache folder.
                # -fopenmp: at::parallel_for is a header template whose OpenMP pragma is
                # compiled into this module; without the flag the kernel ran on one thread
                name = extension_name()
                folder = build_directory(name)
                if not built(folder, name):        # the first decode would sit silent
                    log.warning("compiling the C++ decode step for this machine: once, "
                                "1-3 minutes (APPRENTICE_FAST_DECODE=0 skips it)")
                with build_lock(folder):
                    _ext = load(name=name, sources=[str(SOURCE)], build_directory=str(folder),
                                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:          # no compiler or ninja: the Python path serves
                _failed = f"{type(e).__name__}: {e}"
                log.warning("C++ decode step unavailable, decoding in Python: %s", _failed)
        return _ext


def extension_name() -> str:
    """The build's name: one per CPU capability (and AMX tiles or not: the build compiled on
    a CPU with them holds the tile kernel), so a shared cache keeps them apart."""
    amx = "_amx" if has_amx() else ""
    return f"apprentice_decode_{torch.backends.cpu.get_cpu_capability().lower()}{amx}_omp"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them in /proc/cpuinfo (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def has_amx() -> bool:
    """Whether this CPU has AMX-BF16 tiles."""
    return "amx_bf16" in cpu_flags()


def build_directory(name: str) -> Path:
    """Where extension `name` is built: under torch's extensions folder
    ($TORCH_EXTENSIONS_DIR, else torch's default), one folder per Python and torch version."""
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return (Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}"
            f"_torch{torch.__version__}" / name)


def built(folder: Path, name: str) -> bool:
    """Whether extension `name` has been compiled in `folder` before (torch then only loads
    it, unless its source changed)."""
    return (folder / f"{name}.so").is_file()


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold the build in `folder` for this process. torch marks a build in progress with a
    `lock` file that a build killed midway leaves behind, and every later build waits on it
    forever (a hang at the first decode, with nothing said). This lock is an flock, which
    the kernel releases when its holder dies; every build of ours takes it first, so a `lock`
    file found while holding it is a killed build's, and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "apprentice.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def supported(model: MoEModel) -> str | None:
    """Why `model` cannot use the C++ step (None when it can)."""
    a = model.args
    checks = [
        (not all(a.moe_layers), "dense MLP layers"),
        (a.shared_expert_size > 0, "a shared expert"),
        (a.router_mode != "softmax_topk", f"router {a.router_mode}"),
        (a.qk_norm == "full", "full-width q/k norm"),
        (a.clip_qkv is not None, "clipped q/k/v"),
        (a.hidden_act != "silu", f"activation {a.hidden_act}"),
        (a.embedding_multiplier != 1.0 or a.residual_multiplier != 1.0
         or a.logits_scaling != 1.0, "multipliers"),
        (model.embed_tokens.weight.device.type != "cpu", "not on CPU"),
    ]
    return next((why for bad, why in checks if bad), None)


def packed_weights(model: MoEModel) -> list[torch.Tensor]:
    """The direct step's weights packed (`model.packed_weight`): per layer q/k/v in one, o, the
    router, gate_up and down of all experts; then the output head. Empty where a weight is not
    packed, or q and k are not whole blocks of 16 rows (so their packed copies cannot be
    joined): the step then reads the weights as stored, with the same bits."""
    a = model.args
    if max(a.hidden_size, a.num_heads * a.head_dim, a.expert_size) > PACKED_WIDTH:
        return []                      # a step's few rows read wider weights faster unpacked
    out: list[torch.Tensor] = []
    for block in model.layers:
        att, moe = block.self_attn, block.mlp
        projections = (att.q_proj, att.k_proj, att.v_proj)
        if any(p.weight.shape[0] % 16 for p in projections[:2]):
            return []
        parts = [packed_weight(p.weight) for p in (*projections, att.o_proj, moe.gate)]
        experts = moe.experts.packed()
        if any(p is None for p in parts) or experts is None:
            return []
        out += [torch.cat(parts[:3]), parts[3], parts[4], *experts]
    head = packed_weight(model.lm_head.weight)
    return [] if head is None else out + [head]


def _fp32_scales(copies: tuple[torch.Tensor, ...] | None, pairs: int) -> list[torch.Tensor | None]:
    """`quantize`'s (int8 weight, scale) pairs with the scales in fp32 (the same values: the
    kernels widen them anyway), or Nones for a layer without copies."""
    if copies is None:
        return [None] * 2 * pairs
    return [t.float() if i % 2 and t is not None else t for i, t in enumerate(copies)]


def stepper(model: MoEModel) -> Callable[[torch.Tensor, KVCache], ModelOutput] | None:
    """step(tokens [B], cache) -> the `ModelOutput` of `model(tokens[:, None], cache=cache)`,
    or None when the C++ step is off, unavailable or does not cover `model`."""
    if os.environ.get(ENV, "1") == "0" or supported(model) is not None:
        return None
    ext = extension()
    if ext is None:
        return None
    a = model.args
    layers: list[torch.Tensor | None] = []
    biases: list[torch.Tensor | None] = []
    qkv: list[torch.Tensor | None] = []     # q, k, v's weights (and biases) in one, for bf16:
    quantized = getattr(model, "quantized", None) is not None   # copies, made again by every
    quant: list[torch.Tensor | None] = []   # `stepper` call; quant: the int8 copies, in pairs
    for block in model.layers:
        att, moe = block.self_attn, block.mlp
        projections = (att.q_proj, att.k_proj, att.v_proj)
        with_bias = [p.bias is not None for p in projections]
        if quantized:
            for m in (*projections, att.o_proj):
                quant += _fp32_scales(m.q, 1)
            quant += _fp32_scales(moe.experts.q, 2)
        if model.dtype == torch.bfloat16 and len(set(with_bias)) == 1 and not quantized:
            qkv.append(torch.cat([p.weight for p in projections]))
            qkv.append(torch.cat([p.bias for p in projections]) if with_bias[0] else None)
        else:
            qkv += [None, None]
        qk_w = None
        if a.qk_norm == "head":
            qk_w = torch.cat((att.q_norm.weight.expand(a.num_heads, -1),
                              att.k_norm.weight.expand(a.num_kv_heads, -1)))
        layers += [block.input_layernorm.weight, att.q_proj.weight, att.k_proj.weight,
                   att.v_proj.weight, att.o_proj.weight, qk_w,
                   block.post_attention_layernorm.weight, moe.gate.weight,
                   moe.experts.gate_up, moe.experts.down]
        biases += [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias, att.o_proj.bias]
    if quantized:
        quant += _fp32_scales(model.lm_head.q, 1)
    packed = [] if quantized or any(w is None for w in qkv[::2]) else packed_weights(model)
    model._rope(torch.zeros(1, 1, dtype=torch.long), model.dtype)      # build the tables
    cos, sin = model._rope_table
    upcast = UPCAST_CPU
    direct = os.environ.get(DIRECT, "1") != "0"

    def step(tokens: torch.Tensor, cache: KVCache) -> ModelOutput:
        past = cache.pos
        if past + 1 > cache.max_len:
            raise ValueError(f"KV cache overflow: {past + 1} tokens > cache length {cache.max_len}")
        if past + 1 > a.max_position and bool(cache.valid[:, :past].all()):
            # columns past the window are fine only for left-padded rows (positions count a
            # row's own tokens); a row with every column would be past the window
            raise ValueError(f"{past + 1} tokens exceed the context window ({a.max_position})")
        logits, routes = ext.decode_step(
            tokens, past, cache.valid, cos, sin, model.embed_tokens.weight, model.norm.weight,
            model.lm_head.weight, layers, biases, qkv, cache.k, cache.v, a.num_heads,
            a.num_kv_heads, a.head_dim, a.top_k, a.norm_topk_prob, upcast, a.rms_eps, a.scale,
            cache.shared, cache.shared_from, quant, direct, packed)
        cache.pos = past + 1
        return ModelOutput(logits=logits, routes=routes)
    return step
