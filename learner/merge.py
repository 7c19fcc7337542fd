"""Weight averaging of checkpoints: `apprentice learn average OUT A B ...`.

Policies fine-tuned from one start (two GRPO runs, a run and its continuation) lie in one
basin, and the element-wise mean of their weights (a "model soup", Wortsman et al. 2022; the
merge of WARP, Rame et al. 2024) keeps what their updates share and cancels much of the rest:
on the held-out tasks of 2026-12-03 the mean of two consecutive GRPO runs scored above each of
them (README, "Weight averaging"). The averaging is in fp32; the result is written in the
first checkpoint's dtype, with its tokenizer, config and chat template.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from agent_runtime.model import load_model, save_model

KEEP = ("recipe.json",)          # beside the weights, from the first checkpoint: what made it


def mean_state(states: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
               weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """The (weighted) element-wise mean, in fp32, of (label, state) pairs holding the same
    tensors; taken one state at a time, so memory holds two states, not all of them. Raises
    ValueError naming the first state that does not fit the first one."""
    total: dict[str, torch.Tensor] = {}
    first, norm = None, 0.0
    for i, (label, state) in enumerate(states):
        w = 1.0 if weights is None else float(weights[i])
        if first is None:
            first = label
            total = {k: v.float() * w for k, v in state.items()}
        else:
            misfit = sorted(set(state) ^ set(total)) or sorted(
                k for k, v in state.items() if v.shape != total[k].shape)
            if misfit:
                raise ValueError(f"{label} is not the architecture of {first}: {misfit[:3]}")
            for k, v in state.items():
                total[k] += v.float() * w
        norm += w
    if first is None:
        raise ValueError("mean of no states")
    return {k: v / norm for k, v in total.items()}


def average_checkpoints(paths: Sequence[str | Path], out: str | Path,
                        weights: Sequence[float] | None = None) -> Path:
    """Write to `out` the checkpoint whose weights are the (weighted) mean of `paths`'.
    Raises ValueError when they are not one architecture."""
    from learner.recipe.pretrain import MAX_SHARD_BYTES, copy_tokenizer
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError("averaging needs at least two checkpoints")
    weights = list(weights) if weights is not None else [1.0] * len(paths)
    if len(weights) != len(paths) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError("one non-negative weight per checkpoint, not all zero")
    first = load_model(paths[0])
    dtype = first.dtype
    own = first.state_dict()
    mean = mean_state(((str(p), own if i == 0 else load_model(p).state_dict())
                       for i, p in enumerate(paths)), weights)
    first.load_state_dict({k: v.to(own[k].dtype) for k, v in mean.items()})
    out = Path(out)
    save_model(first, out, dtype=dtype, max_shard_bytes=MAX_SHARD_BYTES)
    copy_tokenizer(paths[0], out)
    for name in KEEP:
        if (paths[0] / name).exists():
            shutil.copy2(paths[0] / name, out / name)
    return out


__all__ = ["average_checkpoints", "mean_state"]
