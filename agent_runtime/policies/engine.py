"""`EnginePolicy`: the `Policy` protocol over our MoE engine, tokenizer and chat template.

Renders the conversation with the checkpoint's chat template (one place renders prompts),
generates with the KV-cached engine, streams decoded text, and returns the token ids, behaviour
logprobs and expert routes exactly as generated. Given a `grammar` (an
`agent_runtime.callgrammar.CallGrammar`, which the agent loop passes), it writes only tool
calls that grammar accepts. Weight updates (`swap_state`) wait for the
model call in flight, so a generation always finishes on the weights it started with. It does
not parse tool calls (the agent loop does) and never imports the learner.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from agent_runtime import names
from agent_runtime.model import MoEModel, load_model, load_tokenizer
from agent_runtime.model.generate import Generation, SamplingParams, generate
from agent_runtime.model.heap import trim
from agent_runtime.model.prefix_cache import PrefixCache
from agent_runtime.model.quantize import quantize, requantize
from agent_runtime.mentions import CONFIG_KEY as MENTIONS_KEY
from agent_runtime.policies.base import Completion, resolve_model_path

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


def retry_seed(prompt: Sequence[int], temperature: float, seed: int | None) -> int:
    """The seed of a greedy call's loop retry (`EngineConfig.loop_fallback`): a hash of its
    prompt, the retry's temperature and `EngineConfig.seed`, so it is drawn the same way
    every time."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{len(prompt)}q", *prompt))
    h.update(struct.pack("<dq", temperature, -1 if seed is None else seed))
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass
class EngineConfig:
    temperature: float = 0.0                # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024              # per model call (capped by the context window)
    seed: int | None = None                 # None = a fresh seed per call
    dtype: str | None = None                # None = checkpoint dtype
    device: str = "cpu"
    prefix_cache_mb: int = 256              # keys/values of earlier calls reused (0 = off)
    loop_span: int = 48                     # end a call that repeats itself this many tokens
                                            # (`SamplingParams.loop_span`; 0 = off)
    loop_fallback: tuple[float, ...] = (0.7, 1.0)   # a call that ended in a loop is sampled
                                            # again at each of these temperatures (above the
                                            # configured one) until one does not loop; a
                                            # greedy call's retry from a stream seeded by its
                                            # prompt (`retry_seed`): the same every time
    exact_history: bool = True              # feed the model's own earlier turns as the ids it
                                            # wrote, not re-rendered (`EnginePolicy.render`)
    quantize: str | None = None             # "int8": decode steps read int8 copies of the
                                            # weights (`agent_runtime.model.quantize`)


@dataclass
class Paused:
    """A call whose batch gave way to waiting calls (`complete_many(should_yield=)`), kept to
    go on in a later batch (`complete_many(resume=)`): its prompt, what it generated so far
    (with its call-grammar matcher, mid-way: `Generation.constraint`), its text stream, and
    the weights it began on."""
    prompt: list[int]
    generation: Generation
    stream: Any
    version: int


class TokenBytes:
    """token id -> the bytes it decodes to, kept for the call grammar (which asks for
    thousands of tokens when a draw is refused); `first` [V]: each token's first byte (-1:
    none), so a grammar state can refuse every token of a refused first byte at once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.table = [tokenizer.decode_bytes([t]) for t in range(tokenizer.vocab_size)]
        self.first = torch.tensor([b[0] if b else -1 for b in self.table], dtype=torch.long)

    def __call__(self, token: int) -> bytes:
        if 0 <= token < len(self.table):
            return self.table[token]
        return self.tokenizer.decode_bytes([token])


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _Said:
    """What `EnginePolicy.render` continues: the policy's latest calls (by the `Completion`
    object, with their prompt's rendered text, hashed), and the assistant messages the agent
    made of them (by the message object, `EnginePolicy.remember`) with the ids fed and
    generated. Bounded; thread-safe."""

    def __init__(self, calls: int = 64, messages: int = 512):
        self.sizes = {"calls": calls, "messages": messages}
        self._calls: OrderedDict[int, tuple[Completion, bytes]] = OrderedDict()
        self._messages: OrderedDict[int, tuple[dict, bytes, list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    def _put(self, name: str, key: int, value: tuple) -> None:
        table = getattr(self, f"_{name}")
        with self._lock:
            table.pop(key, None)
            table[key] = value
            while len(table) > self.sizes[name]:
                table.popitem(last=False)

    def call(self, completion: Completion, text: str) -> None:
        self._put("calls", id(completion), (completion, _key(text)))

    def message(self, message: dict, completion: Completion) -> None:
        with self._lock:
            made = self._calls.pop(id(completion), None)
        if made is not None and made[0] is completion:
            fed = list(completion.prompt_ids) + list(completion.completion_ids)
            self._put("messages", id(message), (message, made[1], fed))

    def get(self, message: dict) -> tuple[bytes, list[int]] | None:
        """(the hashed prompt text, the ids fed and generated) of `message`, if remembered."""
        with self._lock:
            said = self._messages.get(id(message))
        return said[1:] if said is not None and said[0] is message else None


class EnginePolicy:
    """A checkpoint + tokenizer + chat template, usable by the agent loop and directly."""

    accepts_grammar = True                  # complete(..., grammar=CallGrammar) (base.constrains)
    delivers_early = True                   # complete_many(..., on_complete=...) (BatchingPolicy)
    pauses = True                           # complete_many(..., should_yield=, resume=) (same)

    def __init__(self, model: MoEModel, tokenizer: Any, template: Any, name: str,
                 config: EngineConfig | None = None, version: int = 0):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.name, self.version = name, version
        self.config = config or EngineConfig()
        self.context_window = model.args.max_position
        # trained with the task's names looked up (agent_runtime.mentions): the loop adds them
        self.mentions = bool(model.hf_config.get(MENTIONS_KEY))
        self._lock = threading.Lock()
        self._tokens: TokenBytes | None = None
        self.prefix_cache = PrefixCache(self.config.prefix_cache_mb * 2**20)
        self._said = _Said()
        specials = getattr(tokenizer, "special_tokens", {}) or {}
        self.stop_token_ids = sorted({specials[t] for t in END_OF_TURN if t in specials}
                                     | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
        self._end_texts = [e for e in (tokenizer.decode([t]) for t in self.stop_token_ids) if e]

    def token_bytes(self, token: int) -> bytes:
        """The bytes token id `token` decodes to (the tokenizer's own table)."""
        return self._token_table()(token)

    def _token_table(self) -> "TokenBytes":
        if self._tokens is None:
            self._tokens = TokenBytes(self.tokenizer)
        return self._tokens

    @classmethod
    def load(cls, spec: str = "default", config: EngineConfig | None = None, version: int = 0,
             **overrides: Any) -> "EnginePolicy":
        from agent_runtime.model.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate

        config = replace(config or EngineConfig(), **overrides)
        path = resolve_model_path(spec)
        model = load_model(path, dtype=config.dtype, device=config.device)
        if config.quantize:
            quantize(model, config.quantize)
        tokenizer = load_tokenizer(path)
        try:
            template = ChatTemplate.from_pretrained(path)
        except (FileNotFoundError, KeyError, ValueError):
            template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
        return cls(model, tokenizer, template, name=spec, config=config, version=version)

    @functools.cached_property
    def end_of_turn_id(self) -> int | None:
        """The stop token the chat template writes after an assistant message (Qwen's
        `<|im_end|>`, not the `<|endoftext|>` that also stops decoding): what ends a turn
        written for this policy by someone else (`learner.tasks.oracle.GuidePolicy`)."""
        mark = "\x00turn\x00"
        text = self._text([{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}],
                          None, add_generation_prompt=False)
        after = text[text.index(mark) + len(mark):] if mark in text else ""
        ends = ((self.tokenizer.decode([t]), t) for t in self.stop_token_ids)
        found = [(after.find(e), t) for e, t in ends if e and e in after]
        return min(found)[1] if found else (self.stop_token_ids or [None])[0]

    # -- prompts -------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of `messages`. Token in, token out (`EngineConfig.exact_history`):
        when the last assistant message is one the agent made of this policy's call
        (`remember`) and the messages before it are still that call's prompt, the prompt is
        that call's ids as fed and generated, then the rest rendered; otherwise the whole
        conversation rendered. Re-rendering differs from what the model wrote wherever it
        sampled ids the tokenizer's merges would not produce, wrote a tool call's JSON with
        other spacing or argument order, or wrote a call the loop could not run: the model
        would read a past it did not write, the prefix cache would miss from there on, and
        the trainer could not score an episode's calls in one row."""
        return self._ids(messages, tools, self._text(messages, tools))

    def remember(self, message: dict, completion: Completion) -> None:
        """The agent made assistant message `message` (the object in its context) of
        `completion`, a call of this policy: prompts that go on from it feed the ids the model
        wrote (`render`). A no-op for completions this policy did not make lately."""
        if self.config.exact_history:
            self._said.message(message, completion)

    def _text(self, messages: list[dict], tools: list[dict] | None,
              add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, tools=tools or None,
                                    add_generation_prompt=add_generation_prompt)

    def _ids(self, messages: list[dict], tools: list[dict] | None, text: str) -> list[int]:
        """`render` of `messages`, whose rendered `text` the caller has."""
        return self._continued(messages, tools, text) or self.tokenizer.encode(text)

    def _continued(self, messages: list[dict], tools: list[dict] | None,
                   text: str) -> list[int] | None:
        """`render`'s exact history, or None when the conversation does not go on from a
        remembered call with the prompt it had."""
        if not self.config.exact_history:
            return None
        k = next((i for i in range(len(messages) - 1, 0, -1)
                  if messages[i].get("role") == "assistant"), None)
        said = self._said.get(messages[k]) if k is not None else None
        if said is None:
            return None
        key, fed = said
        before = self._text(messages[:k], tools)
        through = self._text(messages[:k + 1], tools, add_generation_prompt=False)
        if _key(before) != key or not through.startswith(before) or not text.startswith(through):
            return None
        ends = [through.rfind(e) for e in self._end_texts]      # where the turn's end is
        cut = max(ends, default=-1)
        if cut < len(before):
            return None
        if fed[-1] in self.stop_token_ids:                  # the model ended its turn itself
            cut += len(self._end_texts[ends.index(cut)])
        return fed + self.tokenizer.encode(through[cut:] + text[len(through):])

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return len(self.render(messages, tools))

    # -- generation ----------------------------------------------------------------------
    def _params(self, max_new_tokens: int, **kw: Any) -> SamplingParams:
        """Sampling settings; each row's budget is also held to what its own prompt leaves of
        the context window (`generate(window=)`)."""
        c = self.config
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=c.temperature,
                           top_p=c.top_p, top_k=c.top_k, seed=c.seed, loop_span=c.loop_span,
                           stop_token_ids=self.stop_token_ids)
        return replace(p, **kw)

    def generate(self, prompt_ids: Sequence[int] | list[Sequence[int]], max_new_tokens: int = 64,
                 **kw: Any) -> Generation | list[Generation]:
        """Token ids in, `Generation` out (a list of prompts gives a list)."""
        batched = bool(prompt_ids) and not isinstance(prompt_ids[0], int)
        prompts = list(prompt_ids) if batched else [list(prompt_ids)]
        out, _ = self._generate(prompts, max_new_tokens, **kw)
        return out if batched else out[0]

    def _generate(self, prompts: list[Sequence[int]], max_new_tokens: int,
                  **kw: Any) -> tuple[list[Generation], int]:
        """One batched generation and the version of the weights that made it."""
        on_token = kw.pop("on_token", None)
        on_done = kw.pop("on_done", None)
        should_stop = kw.pop("should_stop", None)
        row_should_stop = kw.pop("row_should_stop", None)
        grammars = kw.pop("grammar", None)
        matchers = kw.pop("matchers", None)       # per row: a matcher already under way
        held = None
        if grammars is not None and any(g is not None for g in grammars):
            held = [g.matcher(self._token_table(), self.stop_token_ids) if g is not None else None
                    for g in grammars]
        if matchers is not None and any(m is not None for m in matchers):
            held = [m if m is not None else (held[i] if held else None)
                    for i, m in enumerate(matchers)]
        resume = kw.pop("resume", None)
        should_yield = kw.pop("should_yield", None)
        params = self._params(max_new_tokens, **kw)
        with self._lock:
            out = generate(self.model, prompts, params, decode=self.tokenizer.decode,
                           on_token=on_token, should_stop=should_stop,
                           row_should_stop=row_should_stop, prefix_cache=self.prefix_cache,
                           constraints=held, resume=resume, should_yield=should_yield,
                           window=self.context_window,
                           on_done=None if on_done is None else
                           lambda row, g: on_done(row, g, self.version))
            trim()                                 # the batch's buffers back to the OS
            return out, self.version

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *,
                 max_new_tokens: int | None = None, on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, grammar: Any = None) -> Completion:
        return self.complete_many([messages], [tools], max_new_tokens=max_new_tokens,
                                  on_text=[on_text], should_stop=[should_stop],
                                  grammar=[grammar])[0]

    def complete_many(self, conversations: Sequence[list[dict]],
                      tools: Sequence[list[dict] | None] | None = None, *,
                      max_new_tokens: int | None = None,
                      on_text: Sequence[Callable[[str], None] | None] | None = None,
                      should_stop: Sequence[Callable[[], bool] | None] | None = None,
                      grammar: Sequence[Any] | None = None,
                      on_complete: Callable[[int, Completion], None] | None = None,
                      should_yield: Callable[[int], bool] | None = None,
                      resume: Sequence[Paused | None] | None = None
                      ) -> list[Completion]:
        """`complete` for several conversations in one batched generation (how a group of
        rollouts, or several agents sharing this policy, decode together). `tools`, `on_text`,
        `should_stop` and `grammar` are given per conversation; a row whose `should_stop()`
        turns true ends "cancelled" and the others go on. `on_complete(i, completion)` hands
        each conversation's completion over as soon as it is final (before the longest row
        of the batch ends), so its agent can run its tools meanwhile.

        Continuous batching (`BatchingPolicy`): once `should_yield(rows)` turns true, the rows still
        decoding end with finish reason "paused" and `meta["paused"]` (a `Paused`); passed back
        as `resume[i]` with the same conversation, such a row goes on where it stopped (its
        keys and values come from the prefix cache), unless the weights changed meanwhile:
        then it starts again. A paused row is never handed to `on_complete`, and the loop
        guard's hotter retries never pause."""
        n = len(conversations)
        if n == 0:
            return []
        tools = list(tools) if tools is not None else [None] * n
        on_text = list(on_text) if on_text is not None else [None] * n
        should_stop = list(should_stop) if should_stop is not None else [None] * n
        grammar = list(grammar) if grammar is not None else [None] * n
        if not len(tools) == len(on_text) == len(should_stop) == len(grammar) == n:
            raise ValueError(f"complete_many: {n} conversations but {len(tools)} tools, "
                             f"{len(on_text)} on_text, {len(should_stop)} should_stop and "
                             f"{len(grammar)} grammar entries")
        resume = list(resume) if resume is not None else [None] * n
        if len(resume) != n:
            raise ValueError(f"complete_many: {n} conversations but {len(resume)} resume entries")
        skip = set(self.stop_token_ids)
        prompts, streams, seeds, texts = [], [], [], []
        for m, t, sink, state in zip(conversations, tools, on_text, resume):
            going_on = state is not None and state.version == self.version
            if state is not None and not going_on:
                state.stream.restart("\n[the weights changed: generating again]\n")
            texts.append(self._text(m, t))
            prompts.append(state.prompt if going_on else self._ids(m, t, texts[-1]))
            streams.append(state.stream if state is not None
                           else _TextStream(self.tokenizer, skip, sink))
            seeds.append(state.generation if going_on else None)
        n_new = max_new_tokens or self.config.max_new_tokens
        cancel = should_stop if any(should_stop) else None
        delivered: dict[int, Completion] = {}

        def done(i: int, gen: Generation, version: int, temperature: float) -> None:
            """Row i ended; hand it over unless the loop guard's retry will run it again."""
            if (on_complete is None or gen.finish_reason == names.FINISH_PAUSED
                    or self._hotter(gen, temperature)):
                return
            delivered[i] = self._completion(prompts[i], gen, version, temperature, skip)
            self._said.call(delivered[i], texts[i])
            on_complete(i, delivered[i])

        gens, version = self._generate(
            [p + list(s.tokens) if s is not None else p for p, s in zip(prompts, seeds)], n_new,
            on_token=lambda row, tok, lp: streams[row].push(tok),
            row_should_stop=cancel, grammar=grammar,
            matchers=[s.constraint if s is not None else None for s in seeds],
            resume=seeds if any(seeds) else None, should_yield=should_yield,
            on_done=lambda row, gen, v: done(row, gen, v, self.config.temperature))
        paused = {i: Paused(prompts[i], g, streams[i], version)
                  for i, g in enumerate(gens) if g.finish_reason == names.FINISH_PAUSED}
        versions, temps = [version] * n, [self.config.temperature] * n
        # Temperature fallback (as Whisper's decoder does): greedy decoding of a small model
        # falls into loops it would fall into again from the same prompt, so a call the loop
        # guard ended is sampled again, hotter. Only the last attempt is returned (and
        # recorded), with the temperature its logprobs are of.
        for t in self.config.loop_fallback:
            redo = [i for i, g in enumerate(gens) if t in self._hotter(g, temps[i])]
            if not redo:
                continue
            for i in redo:
                streams[i].restart(f"\n[repeating itself: sampling again at temperature {t}]\n")
            # a greedy call's retry draws from a stream seeded by its prompt: the same call
            # gets the same retry, alone or beside others (an evaluation repeats itself)
            seeds_of = None
            if self.config.temperature <= 0:
                seeds_of = [retry_seed(prompts[i], t, self.config.seed) for i in redo]
            again, v = self._generate([prompts[i] for i in redo], n_new, temperature=t,
                                      row_seeds=seeds_of,
                                      on_token=lambda row, tok, lp: streams[redo[row]].push(tok),
                                      row_should_stop=[cancel[i] for i in redo] if cancel else None,
                                      grammar=[grammar[i] for i in redo],
                                      on_done=lambda row, gen, v, t=t: done(redo[row], gen, v, t))
            for i, gen in zip(redo, again):
                gens[i], versions[i], temps[i] = gen, v, t
        out = [delivered.get(i) or self._completion(prompt, gen, version, temperature, skip)
               for i, (prompt, gen, version, temperature)
               in enumerate(zip(prompts, gens, versions, temps))]
        for i, state in paused.items():
            out[i].meta["paused"] = state
        for i, c in enumerate(out):
            if i not in delivered and i not in paused:
                self._said.call(c, texts[i])
        return out

    def _hotter(self, gen: Generation, temperature: float) -> list[float]:
        """The temperatures a call decoded at `temperature` is sampled again at (the loop
        guard ended it: `loop_fallback`'s hotter ones, in order); [] when it is final."""
        if gen.finish_reason != names.FINISH_LOOP:
            return []
        return [t for t in self.config.loop_fallback if t > temperature]

    def _completion(self, prompt: list[int], gen: Generation, version: int, temperature: float,
                    skip: set[int]) -> Completion:
        text = self.tokenizer.decode([t for t in gen.tokens if t not in skip])
        routes = gen.routes.numpy() if gen.routes is not None else None
        return Completion(text=text, prompt_ids=prompt, completion_ids=gen.tokens,
                          logprobs=gen.logprobs, routes=routes, finish_reason=gen.finish_reason,
                          version=version, temperature=temperature,
                          meta={"forced": gen.forced} if gen.forced else {})

    # -- weight updates ------------------------------------------------------------------
    def swap_state(self, update: Callable[[dict[str, torch.Tensor]], None], version: int) -> None:
        """Apply `update(state_dict)` in place between model calls and set the new version."""
        with self._lock, torch.no_grad():
            self.prefix_cache.clear()            # its keys and values are the old weights'
            update(self.model.state_dict())
            requantize(self.model)               # int8 copies of the new weights, if any
            self.version = version

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the full state `state` (a learner's published weights) into the model, as
        `version`, between model calls (`swap_state`)."""
        self.swap_state(lambda sd: [sd[k].copy_(v) for k, v in state.items()], version)


class _TextStream:
    """Turns streamed token ids into text deltas without splitting UTF-8 characters."""

    def __init__(self, tokenizer: Any, skip: set[int], sink: Callable[[str], None] | None):
        self.sink, self.skip = sink, skip
        self.token_bytes = lambda t: tokenizer.decode_bytes([t])
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def restart(self, note: str) -> None:
        """The call is generated again: say so, and start decoding afresh."""
        self.decoder.reset()
        if self.sink is not None:
            self.sink(note)

    def push(self, token: int) -> None:
        if self.sink is None or token in self.skip:
            return
        text = self.decoder.decode(self.token_bytes(token))
        if text:
            self.sink(text)
