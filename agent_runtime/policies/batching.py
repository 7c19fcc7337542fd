"""`BatchingPolicy`: one policy shared by many agent threads, their model calls decoded together.

Rollout groups, evaluations and several agents on one machine each call `complete()` from their
own thread. Run one at a time, a small model on a CPU spends most of each token on fixed
per-step costs; run together, eight rows cost little more than one. The wrapper queues
concurrent calls and hands them to the wrapped policy's `complete_many` as one batch:

    shared = BatchingPolicy(EnginePolicy.load(path))
    run_episodes(lambda task: shared, tasks, store, concurrency=8)

A decoding thread of the wrapper's own (started by the first call, gone after `idle_s`
without calls) waits briefly for more calls (until none arrive for `gather_s`, at most
`max_wait_s`), decodes up to `max_batch` of the queued calls that ask for the same
`max_new_tokens`, hands every caller its completion (or the error), and goes on with the calls
that queued meanwhile. No caller decodes for the others: with a policy that `delivers_early`
(the engine), every row is handed over as soon as it ends, so each caller's agent runs its
tools while the batch's longer rows decode (when a caller led the batch on its own thread,
its row came back only with the longest). A caller's `should_stop` cancels its own row only.
Policies without `complete_many` are called one at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from agent_runtime import names
from agent_runtime.policies.base import Completion, batches, constrains


@dataclass(eq=False)
class _Call:
    messages: list[dict]
    tools: list[dict] | None
    max_new_tokens: int | None
    on_text: Callable[[str], None] | None
    should_stop: Callable[[], bool] | None
    grammar: Any = None                        # a CallGrammar, where the policy takes one
    paused: Any = None                         # where its paused row stopped (`pauses`)
    done: bool = False
    result: Completion | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    batches: int = 0
    calls: int = 0
    pauses: int = 0                                    # rows paused for waiting calls
    sizes: list[int] = field(default_factory=list)     # rows per batch, in order

    @property
    def mean_size(self) -> float:
        return sum(self.sizes) / self.batches if self.batches else 0.0


def shared(policy: Any, concurrency: int) -> Any:
    """`policy` for `concurrency` agent threads: wrapped in a `BatchingPolicy` when more than
    one, so their calls decode together."""
    return BatchingPolicy(policy) if concurrency > 1 else policy


class BatchingPolicy:
    """A thread-safe `Policy` whose concurrent `complete()` calls run as batches."""

    def __init__(self, policy: Any, max_batch: int = 16, gather_s: float = 0.005,
                 max_wait_s: float = 0.05, idle_s: float = 0.5, yield_after_s: float = 0.05):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.policy = policy
        self.max_batch, self.gather_s, self.max_wait_s = max_batch, gather_s, max_wait_s
        self.idle_s, self.yield_after_s = idle_s, yield_after_s
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: list[_Call] = []
        self._decoder: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:          # name, version, count_tokens, ...
        return getattr(self.policy, name)

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *,
                 max_new_tokens: int | None = None, on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, grammar: Any = None) -> Completion:
        call = _Call(messages, tools, max_new_tokens, on_text, should_stop, grammar)
        with self._cond:
            self._queue.append(call)
            if self._decoder is None:
                self._start_decoder()
            self._cond.notify_all()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _serve(self) -> None:
        """The decoding thread: batches while calls come, ends after `idle_s` without any."""
        with self._cond:
            try:
                while True:
                    if not self._queue:
                        self._cond.wait(self.idle_s)
                        if not self._queue:
                            return
                    self._lead()                   # releases the lock while decoding
                    self._cond.notify_all()        # its callers
            finally:
                self._decoder = None
                if self._queue:                    # it died of an error: the waiting calls
                    self._start_decoder()          # get another
                self._cond.notify_all()

    def _start_decoder(self) -> None:
        """Start the decoding thread (called holding the lock, when none runs)."""
        self._decoder = threading.Thread(target=self._serve, daemon=True,
                                         name="apprentice-batching")
        self._decoder.start()

    def _lead(self) -> None:
        """Gather, take one batch off the queue and decode it (called holding the lock)."""
        start = time.monotonic()
        while len(self._queue) < self.max_batch:
            seen = len(self._queue)
            left = self.max_wait_s - (time.monotonic() - start)
            if left <= 0:
                break
            self._cond.wait(min(self.gather_s, left))
            if len(self._queue) == seen:
                break                              # nobody else came: go
        first = self._queue[0].max_new_tokens
        batch = [c for c in self._queue if c.max_new_tokens == first][:self.max_batch]
        self._queue = [c for c in self._queue if c not in batch]
        self.stats.batches += 1                    # counted as it starts: a caller whose row
        self.stats.calls += sum(c.paused is None for c in batch)     # was handed over early
        self.stats.sizes.append(len(batch))        # may return (and look) before it ends
        self._cond.release()
        try:
            self._decode(batch)
        finally:
            self._cond.acquire()
            again = [c for c in batch if c.paused is not None and c.result is None
                     and c.error is None]
            self._queue[:0] = again                # paused rows go on first, in the next batch
            self.stats.pauses += len(again)
            for c in batch:
                c.done = c not in again

    def _yielder(self, max_new_tokens: int | None) -> Callable[[int], bool]:
        """should_yield for a batch: once it has run `yield_after_s`, give way when at least
        as many calls that could join it (the same budget) wait as it has rows still
        decoding. Its rows pause, and the next batch holds them and the waiting calls
        (continuous batching: a call no longer waits for the longest row of the batch that
        was running when it came). A pause costs each row a copy of its keys and values and
        one token's prefill, so a batch gives way only when it would at least double."""
        start = time.monotonic()

        def should_yield(rows: int) -> bool:
            if time.monotonic() - start < self.yield_after_s:
                return False
            waiting = sum(c.max_new_tokens == max_new_tokens for c in list(self._queue))
            return waiting >= max(rows, 1) and rows + waiting <= self.max_batch
        return should_yield

    def _decode(self, batch: list[_Call]) -> None:
        try:
            held = constrains(self.policy)
            pausing = batches(self.policy) and getattr(self.policy, "pauses", False)
            if not batches(self.policy) or (len(batch) == 1 and not pausing):
                for c in batch:
                    try:
                        c.result = self.policy.complete(
                            c.messages, c.tools, max_new_tokens=c.max_new_tokens,
                            on_text=c.on_text, should_stop=c.should_stop,
                            **({"grammar": c.grammar} if held and c.grammar is not None else {}))
                    except Exception as exc:       # noqa: BLE001 - handed to its caller
                        c.error = exc
                return
            def deliver(i: int, completion: Completion) -> None:
                with self._cond:                   # its caller goes on while the batch runs
                    batch[i].result, batch[i].done = completion, True
                    self._cond.notify_all()

            early = {"on_complete": deliver} if getattr(self.policy, "delivers_early", False) \
                else {}
            if pausing:
                early.update(should_yield=self._yielder(batch[0].max_new_tokens),
                             resume=[c.paused for c in batch])
            results = self.policy.complete_many([c.messages for c in batch], [c.tools for c in batch],
                           max_new_tokens=batch[0].max_new_tokens,
                           on_text=[c.on_text for c in batch],
                           should_stop=[c.should_stop for c in batch],
                           **({"grammar": [c.grammar for c in batch]} if held else {}), **early)
            for c, r in zip(batch, results):
                if r.finish_reason == names.FINISH_PAUSED:
                    c.paused = r.meta["paused"]
                else:
                    c.result, c.paused = r, None
        except BaseException as exc:               # every caller in the batch sees it
            for c in batch:
                if c.result is None and c.error is None:
                    c.error = exc
            if not isinstance(exc, Exception):
                raise
