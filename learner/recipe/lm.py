"""The language-model training loop shared by pre-training and the supervised warm-up.

`train_lm` runs AdamW with linear warm-up and cosine decay on batches a stage supplies
(`batch(step) -> (input_ids [B, T], targets [B, T], loss mask [B, T])`, or the sequences
packed into a prefix tree, `Packed`), adds a Switch-style
load-balancing loss on every router (read through forward hooks, so the engine's `MoEModel` is
used unchanged), computes in bf16 where the hardware has native bf16 matmuls (`precision`),
and writes a resumable `state.pt` (model,
optimizer, step, metrics so far) every `checkpoint_every` steps. Batches are a function of the
step, so a resumed run sees the same data as an uninterrupted one.

It does not build data, evaluate tasks or write HF checkpoints (the stages do).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from agent_runtime.model.model import MoE, MoEModel, Paths, token_logprobs
from learner.precision import Bf16Copy, bf16_compute

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Packed:
    """A batch's sequences packed into one prefix tree (`agent_runtime.model.Paths`): the
    positions several sequences start with (SFT's system prompt and tool listing) fed once.
    `targets` [M]: the trained tokens, the loss their mean (as `targets[mask]`'s in a `Batch`);
    `rows` [M]: each one's row among the logits at `at` [1, N] (None: one token a row, in
    order)."""
    ids: torch.Tensor               # [1, N] packed token ids
    positions: torch.Tensor         # [1, N] each one's position in its sequences
    paths: Paths
    at: torch.Tensor                # [1, N] bool: where logits are computed
    targets: torch.Tensor           # [M]
    rows: torch.Tensor | None = None    # [M]

    def to(self, device: str) -> "Packed":
        move = lambda t: t.to(device, non_blocking=True)            # noqa: E731
        return Packed(move(self.ids), move(self.positions),
                      Paths(move(self.paths.index), move(self.paths.take), self.paths.spans),
                      move(self.at), move(self.targets),
                      None if self.rows is None else move(self.rows))


@dataclass
class LMConfig:
    steps: int = 1000               # optimizer steps of the stage
    lr: float = 3e-3                # peak learning rate
    min_lr_ratio: float = 0.1       # cosine decays to lr * this
    warmup: int = 50                # linear warm-up steps
    weight_decay: float = 0.1       # AdamW decoupled decay (matrices only)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW moment decay rates
    grad_clip: float = 1.0          # max global gradient norm
    aux_coef: float = 0.01          # weight of the router load-balancing loss
    checkpoint_every: int = 200     # steps between resumable checkpoints (and at the end)
    log_every: int = 20             # steps between metric rows
    max_seconds: float = 0.0        # stop early after this wall time (0 = no limit)
    fit_to_time: bool = False       # with max_seconds: after 10 steps and every 50 after that, fit
                                    # `steps` to the time left at the speed of the last 50 steps (a
                                    # stage slowed by other work at its start still uses its budget);
                                    # the plan is saved for resuming
    seed: int = 0                   # torch seed of initialization-independent randomness
    head_on_mask: bool = False      # output head only where the loss mask is set (SFT: the
                                    # completions, a small share of each sequence)
    precision: str = "auto"         # "fp32", "bf16" (forward and backward in bf16, fp32 master
                                    # weights and AdamW: `learner.precision`), or "auto": bf16 on
                                    # CUDA (autocast) and on CPUs with native bf16 matmuls


def lr_at(step: int, c: LMConfig, total: int | None = None) -> float:
    total = c.steps if total is None else total
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    progress = (step - c.warmup) / max(1, total - c.warmup)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class RouterStats:
    """Captures every router's logits during a forward; `aux_loss()` is Switch's balance loss
    E * sum_e f_e * P_e (f: share of top-k slots, P: mean probability), averaged over layers."""

    def __init__(self, model: MoEModel):
        self.logits: list[torch.Tensor] = []
        self.hooks = [m.gate.register_forward_hook(self._hook)
                      for m in model.modules() if isinstance(m, MoE)]
        self.k = model.args.top_k

    def _hook(self, module, inputs, output) -> None:
        self.logits.append(output)

    def aux_loss(self) -> torch.Tensor:
        losses = []
        for logits in self.logits:
            probs = logits.float().softmax(-1)                        # [N, E]
            E = probs.shape[-1]
            top = probs.topk(self.k, dim=-1).indices
            f = torch.zeros_like(probs).scatter_(-1, top, 1.0).mean(0) / self.k
            losses.append(E * (f * probs.mean(0)).sum())
        self.logits = []
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions where `mask` is set."""
    ce = -token_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    m = mask.reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1.0)


def make_optimizer(model: MoEModel, c: LMConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=c.lr, betas=tuple(c.betas),
                             fused=next(model.parameters()).is_cuda)


def train_lm(model: MoEModel, batch: Callable[[int], Batch | Packed], c: LMConfig,
             state_dir: Path, device: str = "cpu",
             evaluate: Callable[[], dict] | None = None,
             eval_every: int = 0, log: Callable[[dict], None] = print) -> dict:
    """Train `model` (fp32 masters on `device`) for `c.steps`, resuming from `state_dir`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    model.to(device=device, dtype=torch.float32).train()
    opt = make_optimizer(model, c)
    start, history, total, spent = 0, [], c.steps, 0.0
    state_path = state_dir / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
        total = state.get("total", c.steps) if c.fit_to_time else c.steps
        spent = state.get("seconds", 0.0)   # the budget is the run's, not each process's
        log({"resumed_at": start, "seconds_spent": round(spent, 1)})
    torch.manual_seed(c.seed + start)
    bf16 = bf16_compute(c.precision, device)
    shadow = Bf16Copy(model) if bf16 and not device.startswith("cuda") else None
    net = shadow.synced() if shadow else model              # what the forward runs on
    stats = RouterStats(net)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16) \
        if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    t0, tokens, seen, step = time.time(), 0, 0, start
    begun = t0 - spent                     # when the run would have started, uninterrupted
    marks = [(start, t0)]                  # (step, time) where the plan was last fitted
    window: list[float] = []
    try:
        while step < total:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, c, total)
            b = batch(step)
            if isinstance(b, Packed):
                b = b.to(device)
                with autocast:
                    logits = net(b.ids, positions=b.positions, paths=b.paths,
                                 logits_at=b.at).logits                    # [N, V]
                if b.rows is not None:
                    logits = logits.index_select(0, b.rows)
                loss = -token_logprobs(logits, b.targets).mean()
                ids, trained = b.ids, len(b.targets)
            else:
                ids, targets, mask = (t.to(device, non_blocking=True) for t in b)
                with autocast:
                    if c.head_on_mask:
                        logits = net(ids, logits_at=mask).logits          # [N, V]
                    else:
                        logits = net(ids).logits
                if c.head_on_mask:
                    loss = -token_logprobs(logits, targets[mask]).mean()
                else:
                    loss = masked_loss(logits, targets, mask)
                trained = int(mask.sum())
            aux = stats.aux_loss()
            opt.zero_grad(set_to_none=True)
            (loss + c.aux_coef * aux).backward()
            if shadow:
                shadow.grads_to_master()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip or float("inf"))
            opt.step()
            if shadow:
                net = shadow.synced()
            tokens += trained
            seen += ids.numel()                 # positions fed (a packed tree's once each)
            window.append(loss.item())
            step = done = step + 1
            if c.fit_to_time and c.max_seconds and (done - start == 10 or
                                                    (done - start) % 50 == 0):
                now = time.time()
                marks.append((done, now))
                (s0, m0), (s1, m1) = marks[-2], marks[-1]
                per_step = (m1 - m0) / (s1 - s0)        # the last stretch: today's speed
                total = min(c.steps, done + int((c.max_seconds - (now - begun)) / per_step))
                log({"planned_steps": total, "seconds_per_step": per_step})
            if done % c.log_every == 0 or done == total:
                row = {"step": done, "loss": sum(window) / len(window), "aux": aux.item(),
                       "grad_norm": float(norm), "lr": lr_at(done - 1, c, total),
                       "tokens_per_s": tokens / max(time.time() - t0, 1e-9),
                       "seen_per_s": seen / max(time.time() - t0, 1e-9)}
                if evaluate is not None and eval_every and (done % eval_every == 0 or done == total):
                    row.update(evaluate())
                    model.train()
                history.append(row)
                log(row)
                window = []
            if done % c.checkpoint_every == 0 or done == total:
                _save_state(state_path, model, opt, done, history, total, time.time() - begun)
            if c.max_seconds and time.time() - begun > c.max_seconds:
                log({"stopped_early_at": done, "seconds": time.time() - begun})
                _save_state(state_path, model, opt, done, history, total, time.time() - begun)
                break
    finally:
        stats.close()
    model.eval()
    return {"steps": step, "planned_steps": total, "seconds": time.time() - begun,
            "history": history, "config": asdict(c), "bf16": bf16}


def _save_state(path: Path, model: MoEModel, opt: torch.optim.Optimizer, step: int,
                history: list[dict], total: int, seconds: float) -> None:
    """The run's state at `step`; `seconds` is its training time so far over every process
    that ran it (a resumed run's budget continues from there)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "history": history, "total": total, "seconds": seconds}, tmp)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
