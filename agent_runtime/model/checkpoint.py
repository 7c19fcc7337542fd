"""Load and save Hugging Face MoE checkpoints (config.json + safetensors, optionally sharded).

Safetensors files are memory-mapped copy-on-write and tensors are views into the mapping when
the dtype already matches, so loading needs little more RAM than the weights themselves; only
per-expert tensors are copied, once, into our fused [E, 2I, H] / [E, H, I] layout. Saving writes
the family's own Hugging Face names, so `transformers` loads what we save unchanged. This module
does not tokenize (see `tokenizer.py`) and does not run the model.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from agent_runtime.model.config import ModelArgs, args_from_hf
from agent_runtime.model.model import MoEModel, rope_frequencies

log = logging.getLogger(__name__)

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


class CheckpointError(ValueError):
    """A checkpoint we cannot load, naming the file, tensor or field at fault."""


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16 or float16)") from None


class SafetensorsFile:
    """A safetensors file mapped copy-on-write; `get(name)` returns a tensor view, no copy."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.path.getsize(path) > 8 + n else None
        header.pop("__metadata__", None)
        self.header, self.base = header, 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = info["shape"]
        count = end - start
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(self._mm, dtype=dtype, count=count // dtype.itemsize,
                             offset=self.base + start)
        return t.view(shape)

    def release(self, name: str) -> None:
        """Drop the mapped pages of a tensor we have copied out (keeps peak RSS near 1x)."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = self.header[name]["data_offsets"]
        page = mmap.PAGESIZE
        lo = -(-(self.base + start) // page) * page
        hi = (self.base + end) // page * page
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class CheckpointReader:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        self.where: dict[str, SafetensorsFile] = {}
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {f: SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
            self.where = {k: files[f] for k, f in weight_map.items()}
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            for p in shards:
                st = SafetensorsFile(p)
                self.where.update({k: st for k in st.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        t = self.where[name].get(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(shape)}")
        return t

    def release(self, name: str) -> None:
        self.where[name].release(name)


def _moe_prefix(a: ModelArgs, i: int) -> str:
    block = "block_sparse_moe" if a.model_type in ("mixtral", "granitemoe") else "mlp"
    return f"model.layers.{i}.{block}"


def _expert_names(a: ModelArgs) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if a.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def _simple_names(model: MoEModel) -> Iterator[tuple[str, str]]:
    """(internal name, HF name) for every parameter stored 1:1 (everything but routed experts)."""
    a = model.args
    for name, _ in model.named_parameters(remove_duplicate=True):
        if ".mlp.experts." in name:
            continue
        if name == "lm_head.weight":
            if not a.tie_embeddings:
                yield name, name
            continue
        if name.startswith("layers.") and ".mlp.gate." in name:
            i = int(name.split(".")[1])
            router = "router.layer" if a.model_type == "granitemoe" else "gate"
            yield name, f"{_moe_prefix(a, i)}.{router}.weight"
            continue
        yield name, "model." + name


def load_model(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu") -> MoEModel:
    """Load an HF-format MoE checkpoint directory. `dtype=None` keeps the checkpoint's dtype."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json")
    hf_config = json.loads(cfg_path.read_text())
    a = args_from_hf(hf_config)
    want = _dtype(dtype)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = MoEModel(a, hf_config)
    meta = dict(model.named_parameters(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}

    def put(name: str, hf_name: str, shape: tuple[int, ...]) -> None:
        t = reader.get(hf_name, shape)
        if want is not None and t.dtype != want:
            state[name] = t.to(want)
            reader.release(hf_name)
        else:
            state[name] = t

    for name, hf_name in _simple_names(model):
        put(name, hf_name, meta[name].shape)
    E, H, I = a.num_experts, a.hidden_size, a.expert_size
    g, u, d = _expert_names(a)
    for i, block in enumerate(model.layers):
        if not block.is_moe:
            continue
        p = _moe_prefix(a, i)
        fused = (f"{p}.input_linear.weight", f"{p}.output_linear.weight") if a.model_type == "granitemoe" \
            else (f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj")
        if fused[0] in reader:
            put(f"layers.{i}.mlp.experts.gate_up", fused[0], (E, 2 * I, H))
            put(f"layers.{i}.mlp.experts.down", fused[1], (E, H, I))
            continue
        first = reader.get(f"{p}.experts.0.{g}.weight", (I, H))
        dt = want or first.dtype
        gate_up = torch.empty(E, 2 * I, H, dtype=dt)
        down = torch.empty(E, H, I, dtype=dt)
        for e in range(E):
            names = [f"{p}.experts.{e}.{n}.weight" for n in (g, u, d)]
            gate_up[e, :I] = reader.get(names[0], (I, H))
            gate_up[e, I:] = reader.get(names[1], (I, H))
            down[e] = reader.get(names[2], (H, I))
            for n in names:
                reader.release(n)
        state[f"layers.{i}.mlp.experts.gate_up"] = gate_up
        state[f"layers.{i}.mlp.experts.down"] = down
    if a.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if a.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_frequencies(a)           # fp32, whatever `dtype` the weights have
    model.eval()
    return model.to(device) if str(device) != "cpu" else model


def hf_state_dict(model: MoEModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under the family's Hugging Face names (per-expert where HF is)."""
    a = model.args
    params = dict(model.named_parameters())

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return (t.to(dtype) if dtype is not None else t).contiguous()

    out = {hf: cast(params[name]) for name, hf in _simple_names(model)}
    g, u, d = _expert_names(a)
    I = a.expert_size
    for i, block in enumerate(model.layers):
        if not block.is_moe:
            continue
        p = _moe_prefix(a, i)
        gate_up, down = block.mlp.experts.gate_up, block.mlp.experts.down
        if a.model_type == "granitemoe":
            out[f"{p}.input_linear.weight"] = cast(gate_up)
            out[f"{p}.output_linear.weight"] = cast(down)
            continue
        for e in range(a.num_experts):
            out[f"{p}.experts.{e}.{g}.weight"] = cast(gate_up[e, :I])
            out[f"{p}.experts.{e}.{u}.weight"] = cast(gate_up[e, I:])
            out[f"{p}.experts.{e}.{d}.weight"] = cast(down[e])
    return out


def save_model(model: MoEModel, path: str | os.PathLike, dtype: str | torch.dtype | None = None,
               max_shard_bytes: int | None = None) -> Path:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    want = _dtype(dtype) or model.dtype
    state = hf_state_dict(model, want)
    cfg = dict(model.hf_config)
    cfg["dtype"] = str(want).removeprefix("torch.")
    cfg["tie_word_embeddings"] = model.args.tie_embeddings
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    meta = {"format": "pt"}
    if not max_shard_bytes or sum(t.numel() * t.element_size() for t in state.values()) <= max_shard_bytes:
        save_file(state, str(path / "model.safetensors"), metadata=meta)
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    weight_map = {}
    for j, shard in enumerate(shards, 1):
        fname = f"model-{j:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path
