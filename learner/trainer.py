"""The GRPO trainer: fp32 master weights, AdamW, the training forward with router replay,
per-step metrics in SQLite, resumable checkpoints, and bf16 policy versions.

    trainer = Trainer.open(model_path, run_dir, TrainerConfig(), versions=VersionStore(...))
    metrics = trainer.step(samples)          # one update; publishes the next version

The training forward feeds prompt + completion[:-1] (the P + T - 1 tokens the behaviour policy
fed) with the recorded routes forced (router replay; the gate weights are recomputed, so the
router still learns), and scores only the T completion tokens. Two diagnostics are computed on
every forward: the route-flip rate (share of (token, MoE layer) pairs where the router's own
top-k set differs from the recorded one; with replay on the forced routes are used anyway)
and the train-vs-behaviour KL (k3 estimate over completion tokens). A step runs one forward
and one backward per micro-batch: the rows of its samples (a conversation's calls share one)
packed into one sequence without padding, rows that start alike (a GRPO group's episodes)
feeding their common prefix once, up to `micro_batch_tokens` positions; the loss is still the
token-level mean over the whole step.

Run folder: `metrics.db` (table `steps`, one row per step), `checkpoints/step-NNNNNNNN.pt`
(model, optimizer, step, version, RNG, the caller's extra state; written atomically, the
newest `keep_checkpoints` kept). Versions go to a `learner.versions.VersionStore`; killing
the process loses at most the steps after the last checkpoint, never a published version.

Not here: advantages and the loss formula (`grpo.py`), rollouts and scheduling (`pipeline.py`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import sqlite_utils
import torch

from agent_runtime.model import MoEModel, load_model, token_logprobs
from agent_runtime.model.model import Paths
from learner.config import TrainerConfig, to_dict
from learner.grpo import (TrainSample, balance_scale, behaviour_kl, loop_mask, mean_or_nan,
                          policy_loss, token_advantages, token_weights, unlikelihood)
from learner.precision import Bf16Copy, bf16_compute

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"


@dataclass
class ForwardOut:
    logprobs: torch.Tensor           # [T] training logprobs of the completion tokens
    flips: int                       # (token, layer) pairs whose own top-k set differs
    routed: int                      # (token, layer) pairs compared


class Trainer:
    """Owns the fp32 master model and its optimizer; one `step()` per training batch."""

    def __init__(self, model: MoEModel, run_dir: str | os.PathLike,
                 config: TrainerConfig | None = None, versions: Any = None, store: Any = None):
        self.config = config or TrainerConfig()
        self.run_dir = Path(run_dir)
        (self.run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        self.model = model.to(device=self.config.device, dtype=torch.float32).train()
        self.model.requires_grad_(True)
        if self.config.trainable:
            for name, p in self.model.named_parameters():
                p.requires_grad_(any(re.search(x, name) for x in self.config.trainable))
            if not any(p.requires_grad for p in self.model.parameters()):
                raise ValueError(f"no parameter name matches trainable={self.config.trainable}")
        o = self.config.optim
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=o.lr, betas=tuple(o.betas),
                                           eps=o.eps, weight_decay=o.weight_decay)
        self.bf16 = bf16_compute(self.config.precision, self.config.device)
        self._work = Bf16Copy(self.model) if self.bf16 else None   # forwards run on it
        self.ref = None
        if self.config.loss.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            if self.bf16:
                self.ref.to(torch.bfloat16)
        self.versions, self.store = versions, store
        self.threads: Callable[[], int] | None = None   # intra-op threads for the next
                                                # micro-batch (`Pipeline`: more while rollout
                                                # workers idle); None: leave as set
        self.step_count = 0
        self.version: int | None = None          # version of the current weights, once published
        self.published: dict[str, torch.Tensor] | None = None
        conn = sqlite3.connect(str(self.run_dir / "metrics.db"), check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        self.db.execute("PRAGMA journal_mode = WAL")

    @classmethod
    def open(cls, model_path: str | os.PathLike, run_dir: str | os.PathLike,
             config: TrainerConfig | None = None, versions: Any = None,
             store: Any = None) -> tuple["Trainer", dict | None]:
        """Resume from the run folder's newest checkpoint, or start fresh from `model_path`
        (seeding torch and publishing the initial weights). Returns the trainer and the extra
        state saved with the checkpoint (None on a fresh start)."""
        config = config or TrainerConfig()
        trainer = cls(load_model(model_path, dtype=torch.float32), run_dir, config, versions, store)
        extra = trainer.resume()
        if extra is None:
            torch.manual_seed(config.seed)
            trainer.publish()
        return trainer, extra

    # -- training forward -------------------------------------------------------------------

    def net(self) -> MoEModel:
        """What the training forward runs on: the fp32 masters, or their bf16 copy."""
        return self._work.synced() if self._work is not None else self.model

    @contextlib.contextmanager
    def _router_choices(self, net: MoEModel, sink: list[torch.Tensor]) -> Iterator[None]:
        """Collect each MoE layer's own top-k choice [N, k] (even when routes are forced)."""
        k = net.args.top_k
        hooks = [b.mlp.gate.register_forward_hook(
                     lambda m, i, out: sink.append(out.detach().float().topk(k, dim=-1).indices))
                 for b in net.layers if b.is_moe]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def forward(self, sample: TrainSample, replay: bool | None = None,
                model: MoEModel | None = None) -> ForwardOut:
        """Training logprobs of `sample`'s completion tokens, with replay as configured."""
        return self.forward_batch([sample], replay, model)[0]

    def forward_batch(self, samples: Sequence[TrainSample], replay: bool | None = None,
                      model: MoEModel | None = None) -> list[ForwardOut]:
        """`forward` of several samples in one forward. The model calls of one episode share a
        row: when a sample's prompt extends an earlier sample's prompt and completion (the next
        call of the same conversation), it is scored in that sample's row instead of feeding
        the whole conversation again (`_rows`), so an episode of n calls costs about one
        forward of its last call instead of n. Under replay, every position of a row takes the
        routes recorded by the first sample that fed it (a completion token's own decode).
        Rows that start with the same tokens and routes (a GRPO group's episodes: one prompt,
        often the same first calls) feed those positions once (`share_prefixes`, `_tree`):
        the rows are packed into one prefix tree whose positions are computed once each, and
        only attention runs along every row (`agent_runtime.model.Paths`); the same values
        as the rows fed one by one. Logits are computed only where a completion token is
        scored."""
        if not samples:
            return []
        replay = self.config.router_replay if replay is None else replay
        recorded = [_recorded_routes(s, self.config.device) for s in samples]
        with_routes = [r is not None for r in recorded]
        if any(with_routes) and not all(with_routes):   # replay (and the flip count) per forward
            parts = [[i for i, w in enumerate(with_routes) if w == side] for side in (True, False)]
            outs = [self.forward_batch([samples[i] for i in part], replay, model) for part in parts]
            merged = dict(zip(parts[0] + parts[1], outs[0] + outs[1]))
            return [merged[i] for i in range(len(samples))]
        dev = self.config.device
        if min(len(s.prompt_ids) for s in samples) < 1:
            raise ValueError("every sample needs at least one prompt token")
        rows = _rows(samples, self.config.share_rows)
        fed, owner, row_routes = [], [], []
        for row in rows:
            last = samples[row[-1]]
            fed.append(np.asarray(list(last.prompt_ids) + list(last.completion_ids[:-1]),
                                  dtype=np.int64))
            own = np.empty(len(fed[-1]), dtype=np.int64)  # the first sample to feed a position
            r = torch.empty((len(own),) + recorded[0].shape[1:], dtype=torch.long,
                            device=dev) if all(with_routes) else None
            for i in reversed(row):                       # owns it (and its routes)
                n = _fed_len(samples[i])
                own[:n] = i
                if r is not None:
                    r[:n] = recorded[i]
            owner.append(own)
            if r is not None:
                row_routes.append(r)
        keys = [f[:, None] for f in fed]
        if row_routes:              # a position is shared only with the routes it was fed with
            keys = [np.concatenate([k, r.reshape(len(k), -1).cpu().numpy()], axis=1)
                    for k, r in zip(keys, row_routes)]
        nodes, N = _tree(keys, self.config.share_prefixes)
        ids, positions, (index, take, spans) = packed_tree(fed, nodes, N)
        routes = None
        if row_routes:
            routes = torch.zeros((N,) + recorded[0].shape[1:], dtype=torch.long, device=dev)
            for b, nd in enumerate(nodes):
                routes[torch.from_numpy(nd).to(dev)] = row_routes[b]
        # each scored completion token: the packed position that predicts it
        order = [i for row in rows for i in row]
        where = {i: b for b, row in enumerate(rows) for i in row}
        T = [len(samples[i].completion_ids) for i in order]
        at = np.concatenate([nodes[where[i]][len(samples[i].prompt_ids) - 1:][:t]
                             for i, t in zip(order, T)])
        scored = np.zeros(N, dtype=bool)
        scored[at] = True
        rank = np.cumsum(scored) - 1                      # logits row of each scored position
        chosen: list[torch.Tensor] = []
        masters = model is None or model is self.model      # not the reference model
        model = self.net() if masters else model
        with self._router_choices(model, chosen) if masters else contextlib.nullcontext():
            out = model(ids[None].to(dev), routes=routes[None] if replay and routes is not None
                        else None, positions=positions[None].to(dev),
                        logits_at=torch.from_numpy(scored)[None].to(dev),
                        paths=Paths(index.to(dev), take.to(dev), spans))
        temps = torch.tensor([_scale(samples[i].temperature, self.config.temperature)
                              for i, t in zip(order, T) for _ in range(t)], device=dev)
        target = torch.tensor([t for i in order for t in samples[i].completion_ids],
                              dtype=torch.long, device=dev)
        lp = _token_logprobs(out.logits, torch.from_numpy(rank[at]).to(dev), target, temps)
        by_sample = dict(zip(order, lp.split(T)))
        flips = [0] * len(samples)
        routed = [0] * len(samples)
        if routes is not None and chosen:
            own = torch.stack(chosen, dim=1).view(N, len(chosen), -1)
            differ = (own.sort(-1).values != routes.sort(-1).values).any(-1)  # [N, L]
            for b, row in enumerate(rows):              # counted per row, as if fed alone
                d = differ[torch.from_numpy(nodes[b]).to(dev)]
                for i in row:
                    mine = torch.from_numpy(owner[b] == i).to(dev)
                    flips[i] += int(d[mine].sum())
                    routed[i] += int(mine.sum()) * differ.shape[-1]
        return [ForwardOut(by_sample[i], flips[i], routed[i]) for i in range(len(samples))]

    def micro_batches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """`samples` in rows (`_rows`: the calls of one conversation share one), packed
        greedily into micro-batches of at most `micro_batch_tokens` positions fed (a prefix
        that rows share counts once, with `share_prefixes`) and twice that in padded rows
        (rows x longest row: attention's share); a longer row goes alone. Rows are taken in
        the order of their tokens, so rows that start alike go together, else shortest
        first."""
        budget = self.config.micro_batch_tokens
        share = self.config.share_prefixes
        rows = _rows(samples, self.config.share_rows)
        feeds = [list(samples[row[-1]].prompt_ids) + list(samples[row[-1]].completion_ids[:-1])
                 for row in rows]
        ranked = sorted(range(len(rows)), key=(lambda b: feeds[b]) if share
                        else (lambda b: len(feeds[b])))
        batches: list[list[int]] = []
        fed = longest = 0
        prev: list[int] = []
        for b in ranked:
            f = feeds[b]
            common = _common(prev, f) if share and batches else 0
            if batches and fed + len(f) - common <= budget \
                    and (len(batches[-1]) + 1) * max(longest, len(f)) <= 2 * budget:
                batches[-1].append(b)
                fed, longest = fed + len(f) - common, max(longest, len(f))
            else:
                batches.append([b])
                fed, longest = len(f), len(f)
            prev = f
        return [[samples[i] for b in batch for i in rows[b]] for batch in batches]

    @torch.no_grad()
    def measure(self, samples: Sequence[TrainSample], replay: bool | None = None) -> dict:
        """Flip rate, behaviour KL and max |logprob difference| without updating anything."""
        acc = _Acc()
        for batch in self.micro_batches(samples):
            for s, out in zip(batch, self.forward_batch(batch, replay)):
                if not s.off_policy:
                    acc.add_forward(out, torch.tensor(s.logprobs, device=out.logprobs.device),
                                    s.forced)
        return acc.diagnostics()

    # -- one update -------------------------------------------------------------------------

    def step(self, samples: Sequence[TrainSample], extra_metrics: dict | None = None,
             extra_state: dict | None = None) -> dict:
        """`config.iterations` optimizer steps on `samples` (each the token-level mean loss
        over the whole batch, one forward and backward per micro-batch), then publish the new
        version, record the metrics row and checkpoint. The row's diagnostics (KL to the
        behaviour policy, route flips) are the first pass's, its loss statistics the last's
        (how far the passes moved the ratios: `clip_frac`, `ratio_mean`). An empty batch
        skips the update."""
        t0 = time.perf_counter()
        c = self.config
        n_tok = sum(s.n_tokens for s in samples)
        scale = balance_scale(samples, c.loss.negatives) if c.loss.balance else 1.0
        batches = self.micro_batches(samples)
        updated = n_tok > 0
        passes, norms = [], []
        for _ in range(max(1, c.iterations) if updated else 1):
            passes.append(self._pass(batches, n_tok, scale))
            if updated:
                params = [p for p in self.model.parameters() if p.grad is not None]
                norms.append(float(torch.nn.utils.clip_grad_norm_(
                    params, c.optim.grad_clip if c.optim.grad_clip > 0 else math.inf)))
                self.optimizer.step()       # the bf16 copy follows (`Bf16Copy.synced`)
        self.step_count += 1
        if updated:
            self.publish()
        row = {"step": self.step_count, "version": self.version, "time": time.time(),
               "updated": int(updated), "samples": len(samples), "tokens": n_tok,
               "replay": int(c.router_replay), "grad_norm": norms[0] if norms else math.nan,
               "lr": c.optim.lr, "negative_scale": scale, "iterations": len(norms),
               **passes[0].diagnostics(), **passes[-1].loss_stats(),
               "train_s": time.perf_counter() - t0, **(extra_metrics or {})}
        self.log_metrics(row)
        if c.checkpoint_every and self.step_count % c.checkpoint_every == 0:
            self.save_checkpoint(extra_state)
        return row

    def _pass(self, batches: list[list[TrainSample]], n_tok: int, scale: float) -> _Acc:
        """One forward and backward over every micro-batch, gradients summed into the fp32
        masters (zeroed first); returns the pass's sums."""
        c = self.config
        acc = _Acc()
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            if self.threads is not None:
                torch.set_num_threads(self.threads())
            outs = self.forward_batch(batch)
            dev = outs[0].logprobs.device
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = torch.cat([o.logprobs for o in self.forward_batch(batch, model=self.ref)])
            behaviour = [o.logprobs.detach() if s.off_policy
                         else torch.tensor(s.logprobs, device=dev) for s, o in zip(batch, outs)]
            advantage = token_advantages(batch).to(dev)
            logprobs = torch.cat([o.logprobs for o in outs])
            guide = torch.tensor([s.off_policy for s in batch for _ in range(s.n_tokens)],
                                 device=dev)
            loss, stats = policy_loss(logprobs, torch.cat(behaviour), advantage, c.loss, ref,
                                      off_policy=guide)
            loss = loss * token_weights(batch, c.loss.negatives, scale).to(dev, loss.dtype)
            if c.loss.unlikelihood > 0:
                loss = loss + c.loss.unlikelihood * unlikelihood(logprobs, loop_mask(batch).to(dev))
            if n_tok:
                (loss.sum() / n_tok).backward()
                if self._work is not None:
                    self._work.grads_to_master()
            for s, out, b in zip(batch, outs, behaviour):
                if not s.off_policy:        # no behaviour policy to compare with
                    acc.add_forward(out, b, s.forced)
            acc.add_loss(float(loss.detach().sum()), stats)
        return acc

    # -- versions -----------------------------------------------------------------------------

    def published_state(self) -> dict[str, torch.Tensor]:
        """The current weights as published (bf16 by default), on the CPU."""
        dtype = getattr(torch, self.config.publish_dtype)
        return {k: v.detach().to("cpu", dtype, copy=True)
                for k, v in self.model.state_dict().items()}

    def publish(self) -> int:
        """Publish the current weights as the next version (to the version store if any)."""
        state = self.published_state()
        if self.versions is not None:
            try:
                self.version = self.versions.publish(state)
            except Exception as exc:
                raise RuntimeError(f"could not publish to the version store at "
                                   f"{getattr(self.versions, 'root', '?')}: {exc} (a store "
                                   f"holding another model's versions? pick another one)") from exc
            if self.store is not None:
                info = self.versions.info(self.version)
                try:
                    self.store.record_policy_version(self.version, info.sha256,
                                                     source="learner:grpo",
                                                     meta={"step": self.step_count,
                                                           "run": str(self.run_dir.name)})
                except ValueError as exc:       # another version store's lineage: keep going
                    log.warning("session store: %s", exc)
        else:
            self.version = (self.version or 0) + 1
        self.published = state
        return self.version

    # -- metrics ------------------------------------------------------------------------------

    def log_metrics(self, row: dict) -> None:
        """Insert or replace the row of `row["step"]` (a step redone after a resume)."""
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        self.db["steps"].upsert(clean, pk="step", alter=True)

    def metrics(self) -> list[dict]:
        if "steps" not in self.db.table_names():
            return []
        return list(self.db.query("SELECT * FROM steps ORDER BY step"))

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        return sorted((self.run_dir / CHECKPOINTS).glob("step-*.pt"))

    def save_checkpoint(self, extra: dict | None = None) -> Path:
        """Write model, optimizer, step, version, RNG and `extra` atomically; prune old ones."""
        path = self.run_dir / CHECKPOINTS / f"step-{self.step_count:08d}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        payload = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "step": self.step_count, "version": self.version, "extra": extra or {},
                   "ref": self.ref.state_dict() if self.ref is not None else None,
                   "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": np.random.get_state()},
                   "config": json.dumps(to_dict(self.config))}
        torch.save(payload, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for old in self.checkpoints()[:-max(1, self.config.keep_checkpoints)]:
            old.unlink(missing_ok=True)
        return path

    def resume(self) -> dict | None:
        """Load the newest checkpoint, if any; returns its extra state (None if none)."""
        for tmp in (self.run_dir / CHECKPOINTS).glob(".step-*.tmp"):   # a write cut short
            tmp.unlink(missing_ok=True)
        found = self.checkpoints()
        if not found:
            return None
        ck = torch.load(found[-1], map_location=self.config.device, weights_only=False)
        self.model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        if self.ref is not None and ck.get("ref") is not None:
            self.ref.load_state_dict(ck["ref"])
        self.step_count, self.version = ck["step"], ck["version"]
        torch.set_rng_state(ck["rng"]["torch"])
        random.setstate(ck["rng"]["python"])
        np.random.set_state(ck["rng"]["numpy"])
        self.published = self.published_state()
        if self.versions is not None and self.version is not None:
            from agent_runtime import delta
            if delta.state_sha256(self.published) != self.versions.info(self.version).sha256:
                log.warning("checkpoint weights differ from published version %s", self.version)
        log.info("resumed %s at step %d (version %s)", found[-1], self.step_count, self.version)
        return ck["extra"]


class _Acc:
    """Sums over the samples of one batch, turned into per-token averages."""

    def __init__(self):
        self.tokens = self.flips = self.routed = 0
        self.kl = self.max_diff = 0.0
        self.loss = 0.0
        self.stats: dict[str, float] = {}

    def add_forward(self, out: ForwardOut, behaviour: torch.Tensor,
                    forced: Sequence[int] = ()) -> None:
        """KL and the largest logprob difference over the tokens the model sampled: a token the
        call grammar chose (`forced`) was not drawn from the behaviour policy, so the k3
        estimate does not apply to it, and its ratio is extreme whenever the two models
        differ at all."""
        lp = out.logprobs.detach()
        sampled = torch.ones(lp.numel(), dtype=torch.bool, device=lp.device)
        sampled[[i for i in forced if 0 <= i < lp.numel()]] = False
        lp, behaviour = lp[sampled], behaviour[sampled]
        self.tokens += lp.numel()
        self.flips += out.flips
        self.routed += out.routed
        self.kl += float(behaviour_kl(lp, behaviour).sum())
        if lp.numel():
            self.max_diff = max(self.max_diff, float((lp - behaviour.to(lp.dtype)).abs().max()))

    def add_loss(self, loss_sum: float, stats: dict) -> None:
        self.loss += loss_sum
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0) + v

    def diagnostics(self) -> dict:
        return {"flip_rate": mean_or_nan(self.flips, self.routed),
                "kl": mean_or_nan(self.kl, self.tokens),
                "max_logprob_diff": self.max_diff if self.tokens else math.nan}

    def loss_stats(self) -> dict:
        n = self.stats.get("tokens", 0)
        clipped = self.stats.get("clip_low", 0) + self.stats.get("clip_high", 0)
        return {"loss": mean_or_nan(self.loss, n),
                "ratio_mean": mean_or_nan(self.stats.get("ratio_sum", 0.0), n),
                "clip_frac": mean_or_nan(clipped, n),
                "truncated_frac": mean_or_nan(self.stats.get("truncated", 0), n),
                "ref_kl": mean_or_nan(self.stats.get("ref_kl_sum", 0.0), n)}


def _scale(recorded: float | None, configured: float) -> float:
    """What a sample's logits are divided by: the temperature its logprobs were recorded at
    (`TrainSample.temperature`; 0 = greedy, recorded unscaled), else the configured one."""
    t = configured if recorded is None else recorded
    return t if t > 0 else 1.0


def _rows(samples: Sequence[TrainSample], share: bool = True) -> list[list[int]]:
    """Indices of `samples` grouped into rows: a sample joins the row whose last sample's
    prompt + completion its own prompt starts with (a later call of the same conversation),
    else it starts a row. A row's last sample feeds every token the row needs. Without
    `share`, every sample is a row of its own."""
    if not share:
        return [[i] for i in range(len(samples))]
    rows: list[list[int]] = []
    for i, s in enumerate(samples):
        prompt = s.prompt_ids
        for row in rows:
            last = samples[row[-1]]
            P, T = len(last.prompt_ids), len(last.completion_ids)
            if len(prompt) >= P + T and T and list(prompt[:P]) == list(last.prompt_ids) \
                    and list(prompt[P:P + T]) == list(last.completion_ids):
                row.append(i)
                break
        else:
            rows.append([i])
    return rows


def _tree(keys: Sequence[np.ndarray], share: bool = True) -> tuple[list[np.ndarray], int]:
    """Rows packed into a prefix tree: keys[b] [L_b, K] are row b's positions (a token and
    the routes it is fed with); returns each row's packed position for each of its positions,
    and how many packed positions there are. A row shares the longest prefix it has in common
    with an earlier row (all K columns equal); the rest of it is new. Without `share`, every
    row is new."""
    nodes: list[np.ndarray] = []
    n = 0
    for key in keys:
        best, common = -1, 0
        for j, other in enumerate(keys[:len(nodes)] if share else ()):
            c = _common(key, other)
            if c > common:
                best, common = j, c
        at = np.empty(len(key), dtype=np.int64)
        if common:
            at[:common] = nodes[best][:common]
        at[common:] = np.arange(n, n + len(key) - common)
        n += len(key) - common
        nodes.append(at)
    return nodes, n


def packed_tree(fed: Sequence[np.ndarray], nodes: Sequence[np.ndarray], n: int
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Rows `fed` (token ids) packed at `nodes` (`_tree`: n packed positions): the packed ids
    [n], each one's position in its rows [n], and `Paths`' index, take and spans (CPU)."""
    R, L = len(fed), max(len(f) for f in fed)
    ids = torch.zeros(n, dtype=torch.long)
    positions = torch.zeros(n, dtype=torch.long)
    index = torch.zeros(R, L, dtype=torch.long)
    take = torch.full((n,), -1, dtype=torch.long)
    spans = torch.zeros(R, 2, dtype=torch.long)           # the places of each path take reads
    for b, (f, nd) in enumerate(zip(fed, nodes)):
        at = torch.from_numpy(nd)
        ids[at] = torch.from_numpy(np.asarray(f, dtype=np.int64))
        positions[at] = torch.arange(len(f))
        index[b, :len(f)], index[b, len(f):] = at, at[-1]
        new = take[at] < 0                                # a suffix: the rest is shared
        take[at[new]] = b * L + torch.arange(len(f))[new]
        spans[b] = torch.tensor([len(f) - int(new.sum()), len(f)])
    return ids, positions, (index, take, spans)


def _common(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two rows: token lists, or [L, K] arrays whose K columns
    must all be equal."""
    m = min(len(a), len(b))
    same = np.asarray(a[:m]) == np.asarray(b[:m])
    if same.ndim > 1:
        same = same.all(axis=1)
    return m if same.all() else int(same.argmin())


def _token_logprobs(logits: torch.Tensor, rows: torch.Tensor, target: torch.Tensor,
                    temps: torch.Tensor) -> torch.Tensor:
    """`token_logprobs(logits[rows], target, temps)` computed once for each distinct (row,
    target, temperature): the completion tokens that rows sharing a prefix both score are
    one position of the packed forward, and mostly predict the same token there."""
    values, temp = torch.unique(temps, return_inverse=True)
    distinct, which = torch.unique(torch.stack([rows, target, temp], dim=1), dim=0,
                                   return_inverse=True)
    first = distinct[:, 0]
    if not torch.equal(first, torch.arange(len(logits), device=first.device)):
        logits = logits[first]                # a position scored for several tokens
    return token_logprobs(logits, distinct[:, 1], values[distinct[:, 2]])[which]


def _fed_len(sample: TrainSample) -> int:
    """Tokens the training forward feeds for `sample`: prompt + completion[:-1]."""
    return len(sample.prompt_ids) + max(len(sample.completion_ids) - 1, 0)


def _recorded_routes(sample: TrainSample, device: str) -> torch.Tensor | None:
    """The sample's recorded routes [P + T - 1, L, k] as int64 on `device`, checked."""
    if sample.routes is None:
        return None
    if sample.routes.shape[0] != _fed_len(sample):
        P, T = len(sample.prompt_ids), len(sample.completion_ids)
        raise ValueError(f"routes cover {sample.routes.shape[0]} tokens; the sample fed "
                         f"{P + T - 1} (prompt {P} + completion {T} - 1)")
    return torch.from_numpy(np.asarray(sample.routes, dtype=np.int64)).to(device)
