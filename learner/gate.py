"""The gate: a candidate version is published only if it does not regress on a fixed small
held-out set of simulated tasks.

Both the serving version and the candidate run the same `n_tasks` held-out instances (fixed
seed, greedy, real agent episodes with the normal tools and sandbox, graded by the hidden
tests) and are compared on four numbers:

    pass@1          share of tasks solved                      may drop by <= pass_tasks
                                                               tasks (or pass_margin)
    invalid rate    share of model calls with a tool call      may rise by <= invalid_margin
                    that does not parse or names no tool
    no-call rate    share of model calls with no tool call     may rise by <= no_call_margin
                    at all (asking or talking instead of acting)
    repeat rate     share of model calls repeating an earlier  may rise by <= repeat_margin
                    call of their episode with the same result

A rate's margin also widens to `z` standard errors of the difference between the two runs
(pooled over both runs' model calls): with 8 tasks, ~80 model calls a run, a rate near 0.1
has a standard error of ~0.05 on the difference, and the bare 2-point margin rejected
candidates whose invalid calls rose by chance (bench/online.py: serving measured at 0.077,
candidates at 0.130 and 0.217; earlier versions of the same line measured 0.13-0.16). With
`z` = 1.645 a rise is rejected when a one-sided test at 5 % calls it real, or when it exceeds
the fixed margin and the runs are large enough to tell, and always when it exceeds
`max_noise_margin` (10 points), however few the calls.

pass@1 may fall by one task (`pass_tasks`). Greedy episodes of code-writing tasks turn on one
token: in one bench/online.py run on the default model (eight cycles, 13 candidates gated),
the serving version solved a fix_bug instance that every one of the 13 candidates failed,
while 5 of them solved one or two it failed, so with no allowance the gate rejected every
candidate that did not happen to gain a task, whatever the update did. A drop of two tasks
is rejected, and the comparison with the line's start (below) holds the whole line to one
task: one task of noise in all, not one per cycle.

Why 24 tasks: the gate sees a pass@1 regression only on tasks the serving version solves.
The default model solved 1 of the first 8 held-out tasks, and the fifteenth run of
bench/online.py lost 5 of the 9 of its 40 evaluation tasks it had solved while every
cycle's gate measured 1 of 8 for serving and candidate alike; on 24 tasks it solves 5
(measured: 110 s on 2 cores, 221 model calls). Each version is measured once (the cache
below), so a cycle pays for the candidate's episodes only.

The rates watch for the reward hacks Cursor reported with online RL from user signals:
emitting broken tool calls so nothing can go wrong, and asking instead of acting; and for one
bench/online.py found, a user who likes test runs getting them again and again until the step
budget is spent (`sentiment.repeated_calls`). The episodes
run without the call grammar (`free_calls`): the engine serves calls held to their form,
which would hide a candidate whose own calls broke. The candidate is
compared with the start of its version line (the base model, version 1) on the same margins
as well: drift that stays inside the noise margin cycle by cycle adds up, and the line's
start is the fixed reference it adds up from. A rejected candidate's reason names every
number that regressed (and whether against the serving version or the line's start). Each
state's numbers are cached by its hash (`gate_cache.json`), so each version is evaluated
once: a published candidate's numbers are those the next cycle compares with. The gate's
episodes are recorded in a store of their own (`$APPRENTICE_HOME/learner/gate/`), marked as
`eval` sessions, never in the user's.

Not here: training (`online.py`), publishing (`learner.versions`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from agent_runtime.agent import INVALID_CALL
from agent_runtime.names import ORIGIN_EVAL
from learner.sentiment import repeated_calls


@dataclass
class GateConfig:
    n_tasks: int = 24               # held-out simulated tasks (0: only the numbers' bookkeeping,
                                    # every candidate passes: for tests and tiny models)
    seed: int = 0                   # which held-out instances (fixed, so versions compare)
    max_steps: int = 8              # model calls per episode
    max_new_tokens: int = 512       # tokens per model call (as `apprentice eval`; at 256,
                                    # a turn that edits and then writes a test was cut off
                                    # and counted as an invalid call: bench/online.py)
    concurrency: int = 1            # episodes at once (their calls decode as one batch).
                                    # Above 1, which calls share a batch depends on timing,
                                    # and bf16 numerics on it; the default model on 24 tasks,
                                    # measured: at 4, pass@1 5, 5, 4 and invalid calls
                                    # 0.113, 0.129, 0.174 in three runs; at 1, 5, 5 and
                                    # 0.178, 0.181 in two (tool output with durations still
                                    # varies), in the same time (95-113 s against 110 s)
    pass_tasks: int = 1             # the candidate may solve this many fewer of the tasks
    pass_margin: float = 0.0        # ... or be lower in pass@1 by this share, if more
    invalid_margin: float = 0.02    # the invalid-call rate may be higher by this
    no_call_margin: float = 0.10    # the no-call rate may be higher by this
    repeat_margin: float = 0.02     # the rate of repeated calls (`sentiment.repeated_calls`:
                                    # the same call, the same result) may be higher by this
    z: float = 1.645                # ... or, for both rates, by this many standard errors of
                                    # the difference (pooled); 0: the fixed margins alone
    max_noise_margin: float = 0.10  # ... but never by more than this on noise grounds: a
                                    # handful of calls must not excuse any rise
    sandbox: str | None = None      # "auto" | "off" | "require"; None: $APPRENTICE_SANDBOX
    free_calls: bool = True         # run the episodes without the call grammar
                                    # (AgentConfig.constrain_calls), so that the invalid rate
                                    # is the model's own: serving holds calls' form
                                    # and would hide a candidate that learned to break them


@dataclass
class GateMetrics:
    n: int = 0                      # episodes
    pass_at_1: float = 0.0
    calls: int = 0                  # model calls (summaries excluded)
    invalid_rate: float = 0.0
    no_call_rate: float = 0.0
    repeat_rate: float = 0.0        # model calls repeating an earlier one of their episode


@dataclass
class GateResult:
    passed: bool
    reason: str
    serving: GateMetrics = field(default_factory=GateMetrics)
    candidate: GateMetrics = field(default_factory=GateMetrics)

    def to_json(self) -> dict:
        return {"passed": self.passed, "reason": self.reason,
                "serving": asdict(self.serving), "candidate": asdict(self.candidate)}


def rate_margin(a: float, n_a: int, b: float, n_b: int, fixed: float, z: float,
                cap: float) -> float:
    """How much rate `b` (over n_b model calls) may exceed rate `a` (over n_a): the fixed
    margin, or `z` pooled standard errors of the difference (at most `cap`) if larger."""
    if z <= 0 or n_a <= 0 or n_b <= 0:
        return fixed
    p = (a * n_a + b * n_b) / (n_a + n_b)
    return max(fixed, min(cap, z * math.sqrt(p * (1 - p) * (1 / n_a + 1 / n_b))))


def compare(serving: GateMetrics, candidate: GateMetrics, config: GateConfig,
            against: str = "") -> GateResult:
    """Pass, or fail with every regression beyond its margin named (`against`: what the
    reason says the candidate regressed against, when not the serving version)."""
    problems = []
    allowed = max(config.pass_margin, config.pass_tasks / max(1, serving.n, candidate.n))
    if candidate.pass_at_1 < serving.pass_at_1 - allowed - 1e-9:
        problems.append(f"held-out pass@1 {serving.pass_at_1:.3f} -> {candidate.pass_at_1:.3f}")
    for what, rate, fixed in (("invalid tool calls", "invalid_rate", config.invalid_margin),
                              ("calls without a tool call", "no_call_rate",
                               config.no_call_margin),
                              ("repeated calls", "repeat_rate", config.repeat_margin)):
        a, b = getattr(serving, rate), getattr(candidate, rate)
        margin = rate_margin(a, serving.calls, b, candidate.calls, fixed, config.z,
                             config.max_noise_margin)
        if b > a + margin + 1e-9:
            problems.append(f"{what} {a:.3f} -> {b:.3f} of model calls (margin {margin:.3f})")
    if problems:
        return GateResult(False, f"regressed{against}: " + "; ".join(problems), serving,
                          candidate)
    return GateResult(True, f"no regression on {candidate.n} held-out tasks", serving, candidate)


class Gate:
    """Evaluates states of one checkpoint's architecture on the fixed held-out set."""

    def __init__(self, model_path: str | Path, state_dir: str | Path,
                 config: GateConfig | None = None):
        self.model_path, self.state_dir = str(model_path), Path(state_dir)
        self.config = config or GateConfig()
        self._policy = None

    def check(self, serving: Mapping[str, torch.Tensor], serving_sha: str,
              candidate: Mapping[str, torch.Tensor], candidate_sha: str | None = None,
              anchor: tuple[str, Callable[[], Mapping[str, torch.Tensor]]] | None = None
              ) -> GateResult:
        """Compare the candidate with the serving version and, when `anchor` (its state
        hash, a function loading its state) names the start of the version line, with that
        too: each cycle's drift may stay inside the noise margin while their sum does not
        (bench/online.py, fourteenth run: repeated calls 0.33 -> 0.29 -> 0.33 -> 0.41 ->
        0.40, every step passed). The candidate's numbers are cached under `candidate_sha`,
        so the next cycle's serving version is not measured again."""
        base = self.metrics(serving_sha, lambda: serving)
        measured = self.measure(candidate)
        if candidate_sha:
            self._cache(candidate_sha, measured)
        result = compare(base, measured, self.config)
        if not result.passed or anchor is None or anchor[0] == serving_sha:
            return result
        start = compare(self.metrics(*anchor), measured, self.config,
                        against=" since the version line's start")
        if start.passed:
            return result
        return GateResult(False, start.reason, base, measured)

    def metrics(self, sha: str, state: Callable[[], Mapping[str, torch.Tensor]]
                ) -> GateMetrics:
        """The numbers of the state with hash `sha`: cached, or measured once."""
        known = self._cached(sha)
        if known is None:
            known = self.measure(state())
            self._cache(sha, known)
        return known

    def measure(self, state: Mapping[str, torch.Tensor]) -> GateMetrics:
        """Run the held-out episodes with `state` loaded; their numbers."""
        c = self.config
        if c.n_tasks <= 0:
            return GateMetrics()
        from agent_runtime.agent import AgentConfig
        from agent_runtime.store import SessionStore
        from learner.rollout import run_episodes
        from learner.tasks import generate
        policy = self._load()
        self._engine.load_state(state, 0)
        tasks = generate("heldout", c.n_tasks, seed=c.seed)
        with SessionStore(self.state_dir / "gate") as store:
            episodes = run_episodes(lambda _t: policy, tasks, store, concurrency=c.concurrency,
                                    sandbox=c.sandbox, origin=ORIGIN_EVAL,
                                    agent_config=AgentConfig(max_steps=c.max_steps,
                                                             constrain_calls=not c.free_calls))
            calls = invalid = no_call = repeats = 0
            for e in episodes:
                tool_calls = store.tool_calls(e.session_id)
                kinds = call_kinds(store, e.session_id, tool_calls)
                calls += len(kinds)
                invalid += kinds.count("invalid")
                no_call += kinds.count("none")
                repeats += len(repeated_calls(tool_calls))
        return GateMetrics(n=len(episodes),
                           pass_at_1=sum(e.passed for e in episodes) / max(1, len(episodes)),
                           calls=calls, invalid_rate=invalid / max(1, calls),
                           no_call_rate=no_call / max(1, calls),
                           repeat_rate=repeats / max(1, calls))

    def _load(self) -> Any:
        if self._policy is None:
            from agent_runtime.policies.batching import shared
            from agent_runtime.policies.engine import EnginePolicy
            # greedy; seed 0 makes the engine's loop fallback (a call that looped is
            # sampled again) draw the same for serving and candidate alike
            engine = EnginePolicy.load(self.model_path, temperature=0.0, dtype="bfloat16",
                                       max_new_tokens=self.config.max_new_tokens, seed=0)
            self._engine = engine
            self._policy = shared(engine, self.config.concurrency)
        return self._policy

    # -- the serving version's numbers, once per version -----------------------------------

    def _cache_path(self) -> Path:
        return self.state_dir / "gate_cache.json"

    def _key(self, sha: str) -> str:
        return json.dumps([sha, asdict(self.config)], sort_keys=True)

    def _cached(self, sha: str) -> GateMetrics | None:
        try:
            data = json.loads(self._cache_path().read_text())
        except (OSError, ValueError):
            return None
        hit = data.get(self._key(sha))
        return GateMetrics(**hit) if hit else None

    def _cache(self, sha: str, metrics: GateMetrics) -> None:
        try:
            data = json.loads(self._cache_path().read_text())
        except (OSError, ValueError):
            data = {}
        data = dict(list(data.items())[-15:])                # a few versions are enough
        data[self._key(sha)] = asdict(metrics)
        tmp = self._cache_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self._cache_path())


def call_kinds(store: Any, session_id: str, tool_calls: list[dict] | None = None) -> list[str]:
    """Per model call (assistant message, summaries excluded): "valid", "invalid" (a call
    that did not parse or names no tool) or "none" (no tool call at all). `tool_calls`: the
    session's, when the caller has read them already."""
    if tool_calls is None:
        tool_calls = store.tool_calls(session_id)
    invalid = {r["message_id"] for r in tool_calls if r["name"] == INVALID_CALL}
    out = []
    for m in store.messages(session_id):
        if m["role"] != "assistant" or (m["meta"] or {}).get("kind") == "summary":
            continue
        out.append("invalid" if m["id"] in invalid else "valid" if m["tool_calls"] else "none")
    return out
