"""Prefix caching: keys, values and routes of token prefixes already fed, reused by the next call.

An agent's every model call renders the whole conversation again: the previous prompt, the
previous answer and a tool result. Without a cache each call prefills thousands of tokens to
add a hundred (on 2 CPU cores a 1,700-token prompt costs seconds; the answer a fraction of
that). `generate(..., prefix_cache=cache)` looks up, for each prompt, the stored prefix that
shares the most leading tokens with it, copies those keys and values into the batch's KV cache
and prefills only the rest; afterwards it stores every row's fed tokens (prompt plus answer
but its last token) for the next call. Routes of the reused positions come from the entry, so
a sample's recorded routes still cover every token fed.

Entries hold exactly what the model computed for those tokens with the current weights: the
owner clears the cache when weights change (`EnginePolicy.swap_state`). Entries are evicted
least recently used first once their keys and values exceed `max_bytes`. Not thread-safe: the
engine calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def common_prefix(a, b, limit: int | None = None) -> int:
    """How many leading token ids `a` and `b` share (at most `limit`)."""
    m = min(len(a), len(b), len(a) if limit is None else limit)
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0]) if diff.size else m


@dataclass(eq=False)
class Prefix:
    ids: np.ndarray                         # [n] int64 token ids fed
    k: list[torch.Tensor]                   # per layer [kv_heads, n, head_dim]
    v: list[torch.Tensor]
    routes: torch.Tensor | None             # [n, moe_layers, k] as generate records them

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class PrefixCache:
    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self.entries: list[Prefix] = []       # least recently used first
        self.hits = self.misses = 0
        self.reused_tokens = 0
        self.shared_prefills = 0              # prefixes prefilled once for several rows

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def longest(self, prompt: list[int], limit: int | None = None) -> tuple[Prefix | None, int]:
        """The entry sharing the most leading tokens with `prompt` (at most `limit`) and how
        many; touches nothing."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = len(ids) if limit is None else limit
        best, best_n = None, 0
        for e in self.entries:
            if min(len(e.ids), limit) <= best_n:
                continue
            n = common_prefix(e.ids, ids, limit)
            if n > best_n:
                best, best_n = e, n
        return best, best_n

    def lookup(self, prompt: list[int]) -> tuple[Prefix | None, int]:
        """The entry sharing the most leading tokens with `prompt` and how many of them may be
        reused (at most len(prompt) - 1: the last prompt token is always fed, for its logits)."""
        if not self.entries or len(prompt) < 2:
            self.misses += 1
            return None, 0
        best, best_n = self.longest(prompt, len(prompt) - 1)
        if best is None:
            self.misses += 1
            return None, 0
        self.entries.remove(best)             # most recently used goes last
        self.entries.append(best)
        self.hits += 1
        self.reused_tokens += best_n
        return best, best_n

    def add(self, entry: Prefix, replaces: Prefix | None = None) -> None:
        """Store `entry`; drop `replaces` (the entry it extends, now redundant) and the least
        recently used entries beyond `max_bytes`."""
        if self.max_bytes <= 0:
            return
        if replaces is not None and replaces in self.entries and \
                len(replaces.ids) <= len(entry.ids) and \
                np.array_equal(replaces.ids, entry.ids[:len(replaces.ids)]):
            self.entries.remove(replaces)
        self.entries.append(entry)
        total = self.nbytes
        while total > self.max_bytes and self.entries:
            total -= self.entries.pop(0).nbytes
