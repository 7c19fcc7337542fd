"""Batched generation with a KV cache: greedy / temperature / top-k / top-p, stop strings, seeds.

Returns, per prompt, the sampled tokens, each token's behaviour log-probability under the
distribution it was actually sampled from (after temperature and top-k/top-p filtering; for
greedy decoding, under the untempered model distribution), the expert routes of every token
fed to the model, and a finish reason. Ragged prompts are left-padded. With a `PrefixCache`
each prompt's longest cached prefix is copied in and only the rest is prefilled (rows are then
laid out [pad | cached prefix | pad | new tokens]; positions count real tokens only). A row
may have a constraint (`agent_runtime.callgrammar.CallMatcher`: `allows(token)`,
`advance(token)`): a sampled token it refuses is sampled again without it, so the row draws
from the model's distribution restricted to what the constraint allows; such a token's
logprob is still the model's own (see `Generation.forced`). This module does not render chat
prompts or parse tool calls.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from agent_runtime import names
from agent_runtime.model.fast_decode import extension, stepper
from agent_runtime.model.model import KVCache, ModelOutput, MoEModel
from agent_runtime.model.prefix_cache import Prefix, PrefixCache, common_prefix


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0                # 0 = greedy
    top_p: float = 1.0                      # nucleus mass kept (1 = off)
    top_k: int = 0                          # keep the k most likely tokens (0 = off)
    stop: Sequence[str] = ()                # stop strings (need `decode`); excluded from .text
    stop_token_ids: Sequence[int] = ()      # e.g. eos / <|im_end|>; the token is kept
    seed: int | None = None                 # same seed, same prompt, same weights -> same tokens
    row_seeds: Sequence[int] | None = None  # one random stream per row, seeded apart: a row's
                                            # draws then do not depend on the rows beside it
    loop_span: int = 0                      # end a row ("loop") once its last `loop_span` new
                                            # tokens repeat one pattern (see LoopGuard; 0 = off)


@dataclass
class Generation:
    tokens: list[int]                       # sampled token ids, as generated
    logprobs: list[float]                   # behaviour logprob of each sampled token
    routes: torch.Tensor | None             # [P + T - 1, L, k] uint8/int16: every token fed
    finish_reason: str                      # "eos" | "stop" | "length" | "cancelled" | "loop"
    text: str | None = None                 # decoded completion up to a stop string
    prompt_len: int = 0
    forced: list[int] | None = None         # positions where a constraint refused the sampled
                                            # token and another was drawn (logprob: the model's)
    constraint: object | None = None        # a paused row's constraint, mid-way: resume with it


def _filter_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Log-probabilities [B, V] of the distribution we sample from."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p           # mass before this token already >= p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.log_softmax(-1)


class RowDraws:
    """Uniform numbers drawn from one generator per row (`SamplingParams.row_seeds`), for the
    rows `rows` (generation's live rows, in cache order), instead of one generator for the
    batch: a row draws the numbers it would draw alone, whichever rows share its batch."""

    def __init__(self, gens: Sequence[torch.Generator], rows: Sequence[int]):
        self.gens, self.rows = gens, rows

    def rand(self, n: int, device: torch.device | str) -> torch.Tensor:
        if n != len(self.rows):
            raise ValueError(f"{n} rows to sample but {len(self.rows)} row streams")
        return torch.cat([torch.rand(1, generator=self.gens[b], device=self.gens[b].device)
                          for b in self.rows]).to(device)


def _uniform(gen: torch.Generator | RowDraws | None, n: int, device) -> torch.Tensor:
    if isinstance(gen, RowDraws):
        return gen.rand(n, device)
    return torch.rand(n, generator=gen, device=device)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | RowDraws | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their behaviour logprobs [B] from last-position logits [B, V].
    On a CPU without top-k or top-p, the C++ extension's `sample_rows` does it in one pass
    (the same uniform number per row from `gen`; see its comment), else tensor operations."""
    fused = _fused_sampler(logits, p)
    if fused is not None:
        u = None
        if p.temperature > 0:                    # `_draw`'s number: the generator's next
            u = _uniform(gen, logits.shape[0], logits.device)
        try:
            return fused(logits, p.temperature, u)
        except RuntimeError as e:                # NaN logits: the tensor path's garbage
            log.warning("fused sampler refused a row (%s); sampling with tensor ops", e)
            if u is not None:
                return _sample_with(logits.float(), p, u[:, None])
    logits = logits.float()
    if p.temperature <= 0:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    return _sample_with(logits, p, _uniform(gen, logits.shape[0], logits.device)[:, None])


def _sample_with(logits: torch.Tensor, p: SamplingParams, u: torch.Tensor):
    logp = _filter_logprobs(logits, p)
    tok = _draw(logp.exp(), u)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


FUSED_SAMPLER = os.environ.get("APPRENTICE_FUSED_SAMPLER", "1") != "0"   # read once a process


def _fused_sampler(logits: torch.Tensor, p: SamplingParams) -> Callable | None:
    """The extension's `sample_rows` where it serves these logits and parameters, else None
    (also with APPRENTICE_FUSED_SAMPLER=0, to compare the two paths)."""
    if not FUSED_SAMPLER or logits.device.type != "cpu" or logits.dim() != 2 or (
            p.temperature > 0 and ((p.top_k and p.top_k < logits.shape[-1]) or p.top_p < 1.0)):
        return None
    ext = extension()
    return None if ext is None else ext.sample_rows


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row [B] drawn from `probs` [B, V] (rows sum to ~1; zeros never drawn) by
    inverting the row's cumulative sum at `u` [B, 1], uniform in [0, 1). `torch.multinomial`
    draws V exponentials a row (~170 us for V = 8,192 on a CPU core, more than the default
    model's whole decode step spends on some layers); this draws one."""
    cum = probs.cumsum(-1)
    total = cum[:, -1:]
    u = u.to(cum.dtype) * total
    tok = torch.searchsorted(cum, u, right=True)[:, 0]     # first index whose sum exceeds u
    last = (cum < total).sum(-1)                           # the last index with mass (u
    return torch.minimum(tok, last)                        # rounded up to the total)


log = logging.getLogger(__name__)
MAX_RESAMPLES = 16   # refused draws before the allowed tokens are searched in order


def _own_logprob(logits: torch.Tensor, token: int, p: SamplingParams) -> float:
    """The model's logprob of `token` (one row's logits [V]) under the distribution `sample`
    draws from, or, where filtering removed it, under the tempered distribution."""
    logits = logits.float()[None]
    if p.temperature <= 0:
        return float(logits.log_softmax(-1)[0, token])
    lp = float(_filter_logprobs(logits, p)[0, token])
    return lp if lp > -math.inf else float((logits / p.temperature).log_softmax(-1)[0, token])


def _allowed(logits: torch.Tensor, first: int, p: SamplingParams,
             gen: torch.Generator | RowDraws | None,
             constraint: object) -> int | None:
    """A token drawn from one row's logits [V] as `sample` would, among those the
    constraint `allows` (`first`, already refused, excluded); None when it allows none. A
    constraint with `refused()` (a bool tensor [V] of tokens it refuses on sight; the call
    grammar's: a refused first byte) has those masked first, so the draws that follow are
    not spent on them."""
    allows = constraint.allows
    row = logits.float().clone()
    row[first] = -math.inf
    refused = getattr(constraint, "refused", None)
    mask = refused() if refused is not None else None
    if mask is not None:
        n = min(len(mask), len(row))
        row[:n][mask[:n]] = -math.inf
    for _ in range(MAX_RESAMPLES):
        if not torch.isfinite(row).any():
            return None
        t = int(sample(row[None], p, gen)[0][0])
        if allows(t):
            return t
        row[t] = -math.inf
    values = row.tolist()
    for t in row.argsort(descending=True).tolist():      # rare: most of the mass refused
        if values[t] == -math.inf:
            return None
        if allows(t):
            return t
    return None


class LoopGuard:
    """Spots a degenerate loop in one row's new tokens: the last tokens all equal the token
    `p` before them for one period p, over at least `span` tokens and MIN_REPEATS whole
    periods (`in in in ...`, `orders.cli orders.cli ...`, a line written over and over, a
    sentence of a `finish` summary said again and again). Small greedy models fall into these
    and would otherwise spend the rest of max_new_tokens on them. Periods up to MAX_PERIOD
    keep a run counter each (O(MAX_PERIOD) per token); longer ones, up to LONG_PERIOD, are
    found through the last place the newest GRAM tokens occurred, and one candidate period
    is followed until a token breaks it."""

    MAX_PERIOD = 16
    MIN_REPEATS = 3
    LONG_PERIOD = 256
    GRAM = 4

    def __init__(self, span: int):
        self.span = span
        self.tokens: deque[int] = deque(maxlen=self.MAX_PERIOD + 1)   # the tail it compares
        self.runs = [0] * (self.MAX_PERIOD + 1)      # runs[p]: tail length equal to p back
        self.history: list[int] = []                 # every token, for the long periods
        self.seen: dict[tuple[int, ...], int] = {}   # GRAM tokens -> where they last ended
        self.period = self.run = 0                   # the long period followed, its run

    def push(self, token: int) -> bool:
        """Add a token; True when the tail is now a loop."""
        t, runs = self.tokens, self.runs
        t.append(token)
        n = len(t)
        looping = False
        for period in range(1, min(self.MAX_PERIOD, n - 1) + 1):
            if t[n - 1 - period] == token:
                runs[period] += 1
                if runs[period] + period >= max(self.span, self.MIN_REPEATS * period):
                    looping = True
            else:
                runs[period] = 0
        return self._long(token) or looping

    def _long(self, token: int) -> bool:
        h = self.history
        h.append(token)
        i = len(h) - 1
        if i < self.GRAM - 1:
            return False
        gram = tuple(h[i - self.GRAM + 1:])
        if self.period and h[i - self.period] == token:
            self.run += 1
        else:                                        # no period, or this token broke it
            self.period = self.run = 0
            last = self.seen.get(gram)
            if last is not None and self.MAX_PERIOD < i - last <= self.LONG_PERIOD:
                self.period, self.run = i - last, self.GRAM     # the gram already repeats
        self.seen[gram] = i
        return bool(self.period) and \
            self.run + self.period >= max(self.span, self.MIN_REPEATS * self.period)


DROP_ENDED = True  # rows that ended leave the batch's cache (False: they ride along; benchmarks)


def _route_dtype(model: MoEModel) -> torch.dtype:
    return torch.uint8 if model.args.num_experts <= 256 else torch.int16


@torch.inference_mode()
def generate(model: MoEModel, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None, *,
             decode: Callable[[list[int]], str] | None = None,
             on_token: Callable[[int, int, float], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             row_should_stop: Sequence[Callable[[], bool] | None] | None = None,
             prefix_cache: PrefixCache | None = None,
             constraints: Sequence[object | None] | None = None,
             on_done: Callable[[int, Generation], None] | None = None,
             resume: Sequence[Generation | None] | None = None,
             should_yield: Callable[[int], bool] | None = None,
             window: int | None = None) -> list[Generation]:
    """Generate for a batch of token-id prompts. `on_token(row, token, logprob)` streams.
    `should_stop()` cancels every row; `row_should_stop[b]()` cancels row b alone (its
    generation ends "cancelled" while the other rows go on). `constraints[b]` (or None)
    holds row b to what it allows. `on_done(row, generation)` hands each row's result over
    as soon as that row ends, while the others go on (the same object is returned at the
    end).

    Continuous batching: when `should_yield(rows)` (rows: how many still decode) turns true
    between two steps, every row still
    decoding ends "paused" (its keys and values stored in `prefix_cache`), and a later call
    goes on with it: `resume[b]` is row b's paused `Generation` and `prompts[b]` its prompt
    followed by that generation's tokens. The row keeps its tokens, logprobs and budget
    (`max_new_tokens` counts them), only its last token is fed again, and its result is
    what one uninterrupted call gives (greedy: the same tokens; the routes and the prompt
    length are the original prompt's).

    `window`: each row's budget is `max_new_tokens` or what is left of a window of this many
    tokens after its own prompt, whichever is less (a batch gives each row what it would get
    alone); without it, a prompt that leaves less than `max_new_tokens` of the model's window
    is an error."""
    p = params or SamplingParams()
    if p.stop and decode is None:
        raise ValueError("stop strings need a `decode` function (token ids -> text)")
    B = len(prompts)
    if B == 0:
        return []
    lens = [len(x) for x in prompts]
    if min(lens) == 0:
        raise ValueError("every prompt needs at least one token")
    resumed = list(resume) if resume is not None else [None] * B
    if len(resumed) != B:
        raise ValueError("resume: one paused generation (or None) per prompt")
    seeds = [list(r.tokens) if r is not None else [] for r in resumed]
    seeded = [len(x) for x in seeds]
    own = [lens[b] - seeded[b] for b in range(B)]     # each row's prompt, without its tokens
    if window is None:
        if max(own) + p.max_new_tokens > model.args.max_position:
            raise ValueError(f"prompt ({max(own)}) + max_new_tokens ({p.max_new_tokens}) "
                             f"exceeds the context window ({model.args.max_position})")
        budgets = [p.max_new_tokens] * B
    else:
        window = min(window, model.args.max_position)
        if max(own) >= window:
            raise ValueError(f"prompt of {max(own)} tokens fills the context window ({window})")
        budgets = [min(p.max_new_tokens, window - n) for n in own]
    if any(x and (len(x) >= lens[b] or len(x) > budgets[b]
                  or list(prompts[b][lens[b] - len(x):]) != x) for b, x in enumerate(seeds)):
        raise ValueError("resume: a paused generation's tokens must end its prompt, within "
                         "its budget")
    steps = max(n - k for n, k in zip(budgets, seeded))   # the most any row may still add
    dev = model.embed_tokens.weight.device
    hits: list[tuple[Prefix | None, int]] = [(None, 0)] * B
    if prefix_cache is not None:
        if B > 1 and prefix_cache.max_bytes > 0:
            _prefill_shared(model, prompts, prefix_cache)
        hits = [prefix_cache.lookup(list(x)) for x in prompts]
    C = max(n for _, n in hits)                       # cached columns (right-aligned per row)
    fed = [lens[b] - hits[b][1] for b in range(B)]    # prompt tokens each row prefills
    S = max(fed)
    if C and C + S + steps > model.args.max_position:
        # the padded layout would not fit: each row reuses at most `cap` cached tokens and
        # feeds the rest again, which keeps S (every prompt fits the window with its budget,
        # so lens[b] - cap <= S) and fills the window exactly
        cap = model.args.max_position - steps - S
        hits = [(e, min(n, cap)) if e is not None and min(n, cap) > 0 else (None, 0)
                for e, n in hits]
        C = max(n for _, n in hits)
        fed = [lens[b] - hits[b][1] for b in range(B)]
        S = max(fed)                                  # (a resumed row may need more)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, x in enumerate(prompts):
        ids[b, S - fed[b]:] = torch.tensor(list(x)[lens[b] - fed[b]:], dtype=torch.long)
        mask[b, S - fed[b]:] = True
    ragged = min(fed) != S or any(n != C for _, n in hits)
    ids, mask = ids.to(dev), mask.to(dev)
    gen = torch.Generator(device=dev).manual_seed(p.seed if p.seed is not None else int(torch.randint(2**62, ())))
    row_gens = None
    if p.row_seeds is not None:
        if len(p.row_seeds) != B:
            raise ValueError(f"{B} prompts but {len(p.row_seeds)} row seeds")
        row_gens = [torch.Generator(device=dev).manual_seed(int(x)) for x in p.row_seeds]
    cache = model.new_cache(B, C + S + steps)
    heads: list[torch.Tensor | None] = [None] * B     # routes of each row's reused positions
    if C:
        for b, (entry, n) in enumerate(hits):
            if entry is None:
                continue
            for layer in range(model.args.num_layers):
                cache.k[layer][b, :, C - n:C] = entry.k[layer][:, :n]
                cache.v[layer][b, :, C - n:C] = entry.v[layer][:, :n]
            cache.valid[b, C - n:C] = True
            heads[b] = entry.routes[:n] if entry.routes is not None else None
        cache.pos = C
    out = _prefill(model, ids, mask, cache, fed, [n for _, n in hits]) if ragged else \
        model(ids, cache=cache, logits_to_keep=1)
    # routes of each step, with the cache row each live row had then: [rows, steps, L, k]
    slot = {b: b for b in range(B)}                   # row -> its row in the cache, while live
    route_chunks: list[tuple[torch.Tensor, dict[int, int]]] = []
    if out.routes is not None:
        route_chunks.append((out.routes.to(_route_dtype(model)).cpu(), slot))
    tokens: list[list[int]] = seeds                   # a resumed row's start with its own
    logprobs: list[list[float]] = [list(r.logprobs) if r is not None else [] for r in resumed]
    reasons: list[str | None] = [None] * B
    texts: list[str | None] = [None] * B
    stop_ids = set(p.stop_token_ids)
    guards = [LoopGuard(p.loop_span) for _ in range(B)] if p.loop_span > 0 else None
    if guards is not None:
        for b in range(B):
            for t in seeds[b]:
                guards[b].push(t)
    held = list(constraints) if constraints is not None and any(constraints) else None
    forced: list[list[int]] = [list(r.forced or []) if r is not None else [] for r in resumed]
    fast = stepper(model)                             # the same step in C++, when it can
    if fast is not None and B > 1:                    # a group's common prompt: read once a step
        cache.share(len(os.path.commonprefix([list(x) for x in prompts])))
    done: list[Generation | None] = [None] * B        # rows that ended, with their results
    live = list(range(B))                             # rows still decoding, in cache order

    def finish(b: int) -> Generation:
        """Row b's result (its routes, its prefix stored for the next call), once it ended,
        while it still holds its cache row."""
        n = len(tokens[b]) - seeded[b]                # new tokens of this call
        r = None
        if route_chunks:                              # [S + steps, L, k] of row b so far
            r = torch.cat([c[rows[b]] for c, rows in route_chunks if b in rows])
            r = r[S - fed[b]:S + n - 1]
            if heads[b] is not None:
                r = torch.cat([heads[b], r])
        if prefix_cache is not None and prefix_cache.max_bytes > 0 and n:
            _store(prefix_cache, cache, slot[b], list(prompts[b]) + tokens[b][seeded[b]:-1],
                   r, hits[b][0])
        text = texts[b]
        if text is None and decode is not None:
            text = decode(tokens[b])
        return Generation(tokens=tokens[b], logprobs=logprobs[b], routes=r,
                          finish_reason=reasons[b] or names.FINISH_LENGTH, text=text,
                          prompt_len=lens[b] - seeded[b],
                          forced=forced[b] if held is not None else None,
                          constraint=held[b] if held is not None
                          and reasons[b] == names.FINISH_PAUSED else None)

    for step in range(steps):
        if should_stop is not None and should_stop():
            reasons = [r or names.FINISH_CANCELLED for r in reasons]
            break
        if row_should_stop is not None:
            for b, stop in enumerate(row_should_stop):
                if reasons[b] is None and stop is not None and stop():
                    reasons[b] = names.FINISH_CANCELLED
            if all(r is not None for r in reasons):
                break
        draws = gen if row_gens is None else RowDraws(row_gens, live)
        tok, lp = sample(out.logits[:, -1], p, draws)  # one per live row, in cache order
        tok_l, lp_l = tok.tolist(), lp.tolist()
        if held is not None:
            for j, b in enumerate(live):
                m = held[b]
                if m is None or reasons[b] is not None or m.allows(tok_l[j]):
                    continue
                t = _allowed(out.logits[j, -1], tok_l[j], p,
                             gen if row_gens is None else RowDraws(row_gens, [b]), m)
                if t is None:                 # nothing allowed: the row goes on unconstrained
                    log.info("constraint of row %d allows no token after %r", b,
                             getattr(m, "state", None))
                    held[b] = None
                    continue
                tok[j], tok_l[j] = t, t
                lp_l[j] = _own_logprob(out.logits[j, -1], t, p)
                forced[b].append(len(tokens[b]))
        for j, b in enumerate(live):
            if reasons[b] is not None:
                continue
            if held is not None and held[b] is not None:
                held[b].advance(tok_l[j])
            tokens[b].append(tok_l[j])
            logprobs[b].append(lp_l[j])
            if on_token is not None:
                on_token(b, tok_l[j], lp_l[j])
            if tok_l[j] in stop_ids:
                reasons[b] = names.FINISH_EOS
            elif guards is not None and guards[b].push(tok_l[j]):
                reasons[b] = names.FINISH_LOOP
            elif p.stop and (cut := _stop_at(text := decode(tokens[b]), p.stop)) is not None:
                reasons[b], texts[b] = names.FINISH_STOP, text[:cut]
            elif len(tokens[b]) == budgets[b]:
                reasons[b] = names.FINISH_LENGTH
        if all(r is not None for r in reasons) or step == steps - 1:
            break
        ended = [b for b in live if reasons[b] is not None and done[b] is None]
        if ended:
            # hand each ended row over now (its agent runs tools while the others decode),
            # then drop it from the cache: later steps neither compute nor scan it
            for b in ended:
                done[b] = finish(b)
                if on_done is not None:
                    on_done(b, done[b])
        if ended and DROP_ENDED:
            kept = [j for j, b in enumerate(live) if reasons[b] is None]
            order = cache.keep(kept)
            live = [live[j] for j in order]
            slot = {b: j for j, b in enumerate(live)}
            tok = tok[torch.tensor(order)]
        if should_yield is not None and should_yield(sum(reasons[b] is None for b in live)):
            for b in live:                            # their last token is fed when resumed
                if reasons[b] is None:
                    reasons[b] = names.FINISH_PAUSED
            break
        out = fast(tok, cache) if fast is not None else model(tok[:, None].to(dev), cache=cache)
        if out.routes is not None:
            route_chunks.append((out.routes.to(_route_dtype(model)).cpu(), slot))
    results = [done[b] or finish(b) for b in range(B)]
    if on_done is not None:
        for b in range(B):
            if done[b] is None:
                on_done(b, results[b])
    return results


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    """Where the first of the stop strings `text` holds begins (None: it holds none)."""
    found = [text.find(s) for s in stop if s and s in text]
    return min(found) if found else None


SHARED_MIN = 32  # shared uncached prompt tokens worth one extra single-row prefill

# What a forward of its own costs, in prefill tokens (the default model in bf16, measured on
# a 2.0 GHz Xeon: ~8 ms of operations whatever the rows, a prefill token 0.1-0.2 ms)
FORWARD_TOKENS = 64


def prefill_groups(fed: Sequence[int], forward_tokens: int | None = None) -> list[list[int]]:
    """Rows of a batch (each feeding `fed[b]` tokens) split into groups that prefill in one
    padded forward each: a group computes its rows at its longest row's width, and each
    forward costs `forward_tokens` more. Rows sorted by what they feed, cut where the sum of
    both costs is least (dynamic programming over the cut points); `forward_tokens` defaults
    to `FORWARD_TOKENS`."""
    forward_tokens = FORWARD_TOKENS if forward_tokens is None else forward_tokens
    order = sorted(range(len(fed)), key=lambda b: -fed[b])
    best = [0] + [math.inf] * len(order)               # best[i]: the first i rows grouped
    cut = [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):                             # rows j..i-1, the widest first
            cost = best[j] + forward_tokens + (i - j) * fed[order[j]]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(order)
    while i:
        groups.append(sorted(order[cut[i]:i]))
        i = cut[i]
    return groups[::-1]


def _prefill(model: MoEModel, ids: torch.Tensor, mask: torch.Tensor, cache: KVCache,
             fed: list[int], cached: list[int]) -> ModelOutput:
    """Prefill a ragged batch: `ids` [B, S] right-aligned (`mask` marks each row's `fed`
    tokens), row b's `cached[b]` reused columns ending at `cache.pos`. One padded forward
    computes B x S tokens, each row over the batch's longest cached span; agent calls side by
    side are ragged (one feeds a 500-token file, another a 30-token tool result, a resumed
    row one token), and the padding can be most of the work. The rows run in groups of like
    width instead (`prefill_groups`), each over its own rows' cached columns, and their keys
    and values go to their columns of the batch's cache. The logits (last position) and
    routes ([B, S, L, k], padding positions 0) are what the padded forward returns."""
    B, S = ids.shape
    groups = prefill_groups(fed)
    if len(groups) == 1:
        return model(ids, cache=cache, attention_mask=mask, logits_to_keep=1)
    C = cache.pos
    logits: list[torch.Tensor | None] = [None] * B
    routes: list[torch.Tensor | None] = [None] * B
    for rows in groups:
        width, span = max(fed[b] for b in rows), max(cached[b] for b in rows)
        own = model.new_cache(len(rows), span + width)
        for mine, theirs in zip(own.k + own.v, cache.k + cache.v):
            mine[:, :, :span] = theirs[rows, :, C - span:C]
        own.valid[:, :span] = cache.valid[rows, C - span:C]
        own.pos = span
        ragged = any(fed[b] != width or cached[b] != span for b in rows)
        out = model(ids[rows, S - width:], cache=own, logits_to_keep=1,
                    attention_mask=mask[rows, S - width:] if ragged else None)
        for mine, theirs in zip(own.k + own.v, cache.k + cache.v):
            theirs[rows, :, C + S - width:C + S] = mine[:, :, span:]
        for j, b in enumerate(rows):
            logits[b] = out.logits[j:j + 1]
            if out.routes is not None:
                routes[b] = torch.cat((out.routes.new_zeros((1, S - width) + out.routes.shape[2:]),
                                       out.routes[j:j + 1]), dim=1)
    cache.valid[:, C:C + S] = mask
    cache.pos = C + S
    return ModelOutput(logits=torch.cat(logits),
                       routes=torch.cat(routes) if routes[0] is not None else None)


def _prefill_shared(model: MoEModel, prompts: Sequence[Sequence[int]],
                    prefix_cache: PrefixCache) -> None:
    """Rows that begin alike (a GRPO group's first call: one prompt, eight rows) would each
    prefill the same tokens: prefill their common prefix once, as a cache entry they reuse."""
    first = list(prompts[0])
    n = min(common_prefix(first, x) for x in prompts[1:])
    _, cached = prefix_cache.longest(first[:n])
    if n - cached < SHARED_MIN:
        return
    cache = model.new_cache(1, n)
    out = model(torch.tensor([first[:n]], device=model.embed_tokens.weight.device), cache=cache,
                logits_to_keep=1)
    routes = out.routes[0].to(_route_dtype(model)).cpu() if out.routes is not None else None
    _store(prefix_cache, cache, 0, first[:n], routes, None)
    prefix_cache.shared_prefills += 1


def _store(prefix_cache: PrefixCache, cache: KVCache, row: int, fed: list[int],
           routes: torch.Tensor | None, used: Prefix | None) -> None:
    """Keep row `row`'s keys and values of the tokens it fed (its valid columns, in order;
    columns after them hold tokens fed once the row had finished)."""
    cols = cache.valid[row, :cache.pos].nonzero()[:len(fed), 0]
    if len(cols) != len(fed):
        return                                       # cancelled before its prompt was fed
    entry = Prefix(torch.tensor(fed, dtype=torch.long).numpy(),
                   [k[row][:, cols].clone() for k in cache.k],
                   [v[row][:, cols].clone() for v in cache.v], routes)
    prefix_cache.add(entry, replaces=used)
