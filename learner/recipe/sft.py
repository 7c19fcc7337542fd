"""Stage 3 of the recipe: supervised warm-up on oracle trajectories, in the runtime's own format.

Data: every training task is solved by `OraclePolicy` through the real rollout path
(`learner.rollout.run_episode`: the `Agent` loop, the real tools and sandbox, grading). The
oracle renders its prompts with *our* tokenizer and chat template (the same `ChatTemplate.render`
the engine uses), so each stored sample holds the exact prompt and completion token ids a model
would see and write, `<tool_call>` blocks and tool schemas included. A share of the episodes runs
with a small context window so the self-summarizing context kicks in: those summary requests are
answered with a structured summary (goal, calls made, files touched, next step) built from the
conversation, so the model learns to write the segments the runtime asks for.

Sequences: consecutive samples of a session whose next prompt extends the previous prompt and
completion are merged into one token sequence; the loss mask covers the completion tokens (and
the `<|im_end|>` that ends each one) and nothing else.

It does not pre-train (`pretrain`) or sample from a model (GRPO does, in `learner.pipeline`).
"""

from __future__ import annotations

import os
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from agent_runtime import names
from agent_runtime.context import SUMMARY_REQUEST
from agent_runtime.mentions import CONFIG_KEY as MENTIONS_KEY
from agent_runtime.model.model import Paths
from learner.recipe.lm import LMConfig, Packed, train_lm
from learner.tasks.oracle import OraclePolicy, garble, with_slip


CODE_FAMILIES = ("fix_bug", "implement_function", "add_feature")     # the families that write code


@dataclass
class CodeConfig:
    """The second phase of SFT: the first phase's model trained on, mixed with the stage's
    data, extra oracle episodes of the families that write code (`CODE_FAMILIES`). A model
    this size learns the other families from the data SFT has, but not which body a docstring
    asks for, which comparison is a bug, or what a new function must do: measured on the 200
    held-out tasks, `r13` plus this phase (2,400 episodes, 1,500 steps) went from 41.0 % to
    50.0 %, implement_function 0 -> 7 / 34, fix_bug 6 -> 12 (README, "The shipped model")."""
    tasks: int = 0                  # instances solved by the oracle (0: no second phase)
    task_seed: int = 2              # their generator seed: instances the first phase never saw
    phrasings: float = 0.6          # share of them with composed instructions
    train: LMConfig = field(default_factory=lambda: LMConfig(
        steps=1500, lr=3e-4, warmup=20, weight_decay=0.0, max_seconds=0, fit_to_time=False,
        checkpoint_every=100, log_every=50))
    base_share: float = 0.0         # the first phase's weight in the SFT model: the mean of
                                    # the two phases' weights (`learner.merge`), the second
                                    # phase's own model kept in sft/code (0: the second phase's)


@dataclass
class SFTConfig:
    train: LMConfig = field(default_factory=lambda: LMConfig(
        steps=5000, lr=1e-3, warmup=30, weight_decay=0.0, max_seconds=300, fit_to_time=True,
        checkpoint_every=200))      # the optimization (5 min)
    tasks: int = 1500               # training-split instances solved by the oracle
    task_seed: int = 0              # generate("train", tasks, seed=task_seed)
    phrasings: float = 0.0          # share of those whose instruction is composed from parts
                                    # (`learner.tasks.repo.phrase`), not a fixed sentence
    summary_share: float = 0.15     # episodes run with a small window (summaries happen)
    small_window: tuple[int, int] = (2000, 2800)  # that window, drawn per episode
    context_window: int = 4096      # the model's window (every other episode)
    workers: int = 2                # processes collecting episodes (0: one per core)
    batch_size: int = 16            # sequences per step (right-padded), when batch_tokens is 0
    batch_tokens: int = 0           # else: steps of about this many tokens, sequences of like
                                    # length together (little padding), every sequence once an epoch
    max_len: int = 4096             # longer sequences are cut
    share_prefix: bool = True       # a step's sequences packed into one prefix tree: what
                                    # they start with alike (the system prompt and tool
                                    # listing, ~250 tokens) fed once (the same loss)
    rename: float = 0.0             # share of the sequences in each batch seen with their domain
                                    # words renamed (`learner.recipe.augment`): copy, not recall
    rename_merge: float = 0.0       # of those, the share where two of the words become one
                                    # (names that look alike: `orders.cli orders.csv`)
    instruction_noise: float = 0.0  # share of the sequences in each batch seen with some of
                                    # their task's words replaced by random ones
                                    # (`augment.InstructionNoise`): wording it never saw
    noise_rate: float = 0.5         # ... each plain word the episode does not repeat, this often
    preamble: float = 0.0           # share of the sequences in each batch seen with a sentence
                                    # before their task (`augment.Preamble`): where a name
                                    # stands after an opening says nothing about which it is
    copy_share: float = 0.0         # share of the training sequences that are copy windows
                                    # (`pretrain.copy_window`, as long as the episodes)
    slip_share: float = 0.0         # share of the episodes with one slip and its recovery
                                    # (`with_slip`; the slip itself is not trained on)
    grep_slips: bool = False        # a slip may also be a search that finds nothing (a name
                                    # the code does not have yet, or a typo) and its recovery
    mentions: bool = False          # tasks show where their names are defined
                                    # (agent_runtime.mentions); the model is saved saying so
    misfix_share: float = 0.0       # share of the episodes whose fix first goes in with a typo,
                                    # the check fails, and the next turn repairs it
                                    # (`with_misfix`; the typo'd edit is not trained on)
    heldout_tasks: int = 0          # held-out-split instances solved by the oracle too: the
                                    # SFT checkpoint's loss and exact next tokens on their
                                    # assistant turns (a cheap proxy for pass@1, no decoding)
    code: CodeConfig = field(default_factory=CodeConfig)    # the second phase (off: tasks 0)
    device: str = "auto"            # "auto": cuda when available, else cpu
    seed: int = 0                   # episode windows and batch order


# -- the recording oracle ------------------------------------------------------------------------

class RecordingOracle(OraclePolicy):
    """`OraclePolicy` counting and rendering with a model's tokenizer and chat template, and
    answering summary requests with a summary of the conversation so far. With `slip`, one
    turn of its plan is first played with a copying mistake (`with_slip`); with `misfix`
    (instead), its fix is first played with a typo (`with_misfix`). `slips` holds the texts of
    such turns, which the data masks out."""

    def __init__(self, task, tokenizer, template, context_window: int, slip: bool = False,
                 misfix: bool = False, grep_slips: bool = False, mentions: bool = False):
        super().__init__(task, context_window=context_window, mentions=mentions)
        self.tokenizer, self.template = tokenizer, template
        self.slips: set[str] = set()
        self.misfix: dict | None = None         # the typo'd edit call, when one was played
        if misfix:
            self.turns, self.slips, self.misfix = with_misfix(self.turns,
                                                              random.Random(f"misfix:{task.id}"))
        elif slip:
            self.turns, self.slips = with_slip(self.turns, random.Random(task.id),
                                               task.files if grep_slips else None,
                                               task.instruction)

    def encode_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.template.render(messages, tools=tools or None, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def complete(self, messages: list[dict], tools: list[dict] | None = None, **kw):
        if messages and messages[-1].get("kind") == SUMMARY_REQUEST and not self.summaries:
            self.summaries.append(summarize(messages, [t for t in self.turns
                                                       if t not in self.slips]))
        return super().complete(messages, tools, **kw)


def summarize(messages: list[dict], plan: list[str]) -> str:
    """The summary an oracle would write: goal, calls so far with outcomes, the exact text
    its next edits will replace (it knows its plan), and the next step."""
    from agent_runtime.context import SUMMARY_PREFIX
    from agent_runtime.toolcalls import parse_tool_calls
    task = next((m["content"] for m in messages if m.get("kind") == names.KIND_TASK), "")
    earlier = next((m["content"][len(SUMMARY_PREFIX):] for m in messages
                    if m.get("kind") == names.KIND_SUMMARY), "")
    done = []
    results = {m.get("tool_call_id"): m.get("content") or "" for m in messages if m["role"] == "tool"}
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments") or {}
            what = args.get("path") or args.get("command") or args.get("pattern") or ""
            result = results.get(call.get("id"), "")
            status = "failed: " + result.splitlines()[0][:120] if result.startswith("Error") else "ok"
            done.append(f"- {fn.get('name')} {what}".rstrip() + f" ({status})")
    if earlier:
        prior = earlier.split("## Done so far\n", 1)[-1].split("\n## ", 1)[0].strip()
        done = [line for line in prior.splitlines() if line.startswith("- ")] + done
    facts = []
    for turn in plan:
        for call in parse_tool_calls(turn).calls:
            args = call.arguments or {}
            if call.name == "edit_file" and args.get("old"):
                facts.append(f"- {args['path']} contains:\n```\n{args['old']}\n```")
    step = plan[0].split("<tool_call>", 1)[0].strip() if plan else ""
    return (f"## Goal\n{task}\n## Done so far\n" + ("\n".join(done) or "- nothing yet")
            + "\n## Key facts (exact file paths, names, commands, error messages and test results)\n"
            + ("\n".join(facts) or "- none beyond the above")
            + f"\n## Next steps\n{step or 'Continue with the task.'}")


MISFIX_SAY = ["That did not fix it: my edit has a typo. Correcting it.",
              "Still failing. The text I wrote is not right; fixing my edit.",
              "The check still fails, so my edit was wrong. Correcting the typo."]


def with_misfix(turns: list[str], rng: random.Random) -> tuple[list[str], set[str], dict | None]:
    """The oracle's turns with its fix first written wrong: the first turn making exactly one
    `edit_file` call and followed by a `run_command` check is played with one letter of its
    `new` text dropped or doubled, then the check (which should now fail), then a turn that
    says so and repairs the edit (`old` the typo'd text, `new` the right one), then the check
    again and the rest of the plan. Teaches reading the check's outcome instead of finishing
    after it whatever it printed (an oracle's checks always pass, so nothing else in the
    data shows a failed one). Returns the turns, the set of turns not to train on (the typo'd
    one) and the typo'd call (the collector drops the episode if its check passed anyway);
    the turns unchanged, an empty set and None when no turn qualifies."""
    from agent_runtime.toolcalls import parse_tool_calls
    from learner.tasks.oracle import render_turn
    parsed = [parse_tool_calls(t).calls for t in turns]
    for i, (calls, after) in enumerate(zip(parsed, parsed[1:])):
        if (len(calls) == 1 and calls[0].name == "edit_file"
                and not (calls[0].arguments or {}).get("replace_all")
                and [c.name for c in after] == ["run_command"]):
            break
    else:
        return turns, set(), None
    args = dict(calls[0].arguments)
    before, after_text = str(args.get("old", "")), str(args.get("new", ""))
    a = len(os.path.commonprefix([before, after_text]))         # the typo goes in what the
    b = len(os.path.commonprefix([before[a:][::-1], after_text[a:][::-1]]))  # edit changes
    changed = garble(after_text[a:len(after_text) - b], rng)
    typo = (after_text[:a] + changed + after_text[len(after_text) - b:] if changed
            else garble(after_text, rng))
    if not typo or not args.get("path"):
        return turns, set(), None
    say = turns[i].split("<tool_call>", 1)[0].strip()
    wrong = {"name": "edit_file", "arguments": {**args, "new": typo}}
    misfix = render_turn(say, [wrong])
    repair = render_turn(rng.choice(MISFIX_SAY), [{"name": "edit_file", "arguments": {
        "path": args["path"], "old": typo, "new": args["new"]}}])
    return turns[:i] + [misfix, turns[i + 1], repair] + turns[i + 1:], {misfix}, wrong


def _misfix_failed(store, session_id: str, wrong: dict) -> bool:
    """Did the check after the typo'd edit `wrong` fail (a non-zero exit code)?"""
    calls = store.tool_calls(session_id)
    for n, c in enumerate(calls):
        if c["name"] == "edit_file" and c["arguments"] == wrong["arguments"]:
            check = next((d for d in calls[n + 1:] if d["name"] == "run_command"), None)
            return check is not None and "[exit code: 0]" not in (check.get("result") or "")
    return False


# -- collecting ---------------------------------------------------------------------------------

@dataclass
class Chunk:
    """One collecting process's share of the tasks (picklable: `ProcessPoolExecutor.map`)."""
    tokenizer_dir: str
    numbers: list[int]              # indices into generate(split, ..., seed=task_seed)
    windows: list[int]              # each episode's context window
    task_seed: int = 0
    slipped: list[int] = field(default_factory=list)    # the numbers played with a slip
    misfixed: list[int] = field(default_factory=list)   # ... with a typo'd fix (`with_misfix`)
    split: str = "train"
    phrasings: float = 0.0          # `SFTConfig.phrasings`
    grep_slips: bool = False        # `SFTConfig.grep_slips`
    mentions: bool = False          # `SFTConfig.mentions`


def _collect_chunk(chunk: Chunk) -> dict:
    """Run the oracle on some tasks (one process); return their sequences and counts."""
    tokenizer_dir, numbers, windows = chunk.tokenizer_dir, chunk.numbers, chunk.windows
    slipped, misfixed = set(chunk.slipped), set(chunk.misfixed)
    from agent_runtime.model import load_tokenizer
    from agent_runtime.model.chat_template import ChatTemplate
    from agent_runtime.store import SessionStore
    from learner import tasks as sim
    from learner.rollout import run_episode

    tok = load_tokenizer(tokenizer_dir)
    template = ChatTemplate.from_pretrained(tokenizer_dir)
    eos = tok.special_tokens["<|im_end|>"]
    all_tasks = sim.generate(chunk.split, max(numbers) + 1, seed=chunk.task_seed,
                             phrasings=chunk.phrasings)
    out = {"seqs": [], "episodes": 0, "passed": 0, "samples": 0, "merged": 0, "summaries": 0,
           "slips": 0, "misfixes": 0, "misfix_dropped": 0}
    with tempfile.TemporaryDirectory(prefix="apprentice-sft-") as home:
        store = SessionStore(home)
        for number, window in zip(numbers, windows):
            task = all_tasks[number]
            policy = RecordingOracle(task, tok, template, window, slip=number in slipped,
                                     misfix=number in misfixed, grep_slips=chunk.grep_slips,
                                     mentions=chunk.mentions)
            try:
                ep = run_episode(policy, task, store, max_steps=30)
            except Exception:                   # a broken instance must not stop the stage
                continue
            out["episodes"] += 1
            if not ep.passed:
                continue
            out["passed"] += 1
            if policy.misfix is not None:
                if not _misfix_failed(store, ep.session_id, policy.misfix):
                    out["misfix_dropped"] += 1      # its check passed: "still failing" is false
                    continue
                out["misfixes"] += 1
            samples = store.samples(ep.session_id)
            out["samples"] += len(samples)
            out["summaries"] += len({s["segment"] for s in samples}) - 1
            skip = [tok.decode(list(s["completion_ids"])) in policy.slips for s in samples]
            if policy.misfix is None:           # a misfix episode's masked turn is its typo
                out["slips"] += sum(skip)
            seqs, merged = merge_samples(samples, eos, skip)
            out["merged"] += merged
            out["seqs"].extend(seqs)
        store.close()
    return out


def merge_samples(samples: list[dict], eos: int, skip: list[bool] | None = None
                  ) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(token ids, loss mask) sequences from a session's samples; returns them and how many
    samples were appended to the sequence before them instead of starting a new one. Samples
    flagged in `skip` stay in the sequence as context but are not trained on."""
    seqs: list[tuple[list[int], list[int]]] = []
    merged = 0
    for n, s in enumerate(samples):
        train = 0 if skip and skip[n] else 1
        prompt, completion = list(s["prompt_ids"]), list(s["completion_ids"])
        if s["finish_reason"] in (names.FINISH_STOP, names.FINISH_EOS) and (not completion or completion[-1] != eos):
            completion.append(eos)
        if seqs and len(prompt) >= len(seqs[-1][0]) and prompt[:len(seqs[-1][0])] == seqs[-1][0]:
            ids, mask = seqs[-1]
            extra = prompt[len(ids):]
            ids.extend(extra + completion)
            mask.extend([0] * len(extra) + [train] * len(completion))
            merged += 1
        else:
            seqs.append((prompt + completion, [0] * len(prompt) + [train] * len(completion)))
    return seqs, merged


def collect(tokenizer_dir: Path, out: Path, config: SFTConfig, split: str = "train",
            tasks: int | None = None) -> dict:
    """Solve `tasks` (default `config.tasks`) instances of `split` with the recording oracle;
    save their sequences to `out`. Held-out episodes get the same windows and slips."""
    n = config.tasks if tasks is None else tasks
    return _collect(tokenizer_dir, out, config, list(range(n)), random.Random(config.seed),
                    split, config.task_seed, config.phrasings)


def collect_code(tokenizer_dir: Path, out: Path, config: SFTConfig) -> dict:
    """`config.code.tasks` training instances of the code-writing families (`CODE_FAMILIES`,
    in turn), from the generator seed `config.code.task_seed`, solved like `collect`'s."""
    c = config.code
    return _collect(tokenizer_dir, out, config, code_numbers(c.tasks),
                    random.Random(c.task_seed), "train", c.task_seed, c.phrasings)


def code_numbers(n: int) -> list[int]:
    """The first `n` instance numbers of `generate` (families in turn) that are of
    `CODE_FAMILIES`."""
    from learner import tasks as sim
    picked = [i for i, f in enumerate(sim.FAMILIES) if f in CODE_FAMILIES]
    span = -(-n * len(sim.FAMILIES) // len(picked))
    return [j for j in range(span) if j % len(sim.FAMILIES) in picked][:n]


def _collect(tokenizer_dir: Path, out: Path, config: SFTConfig, numbers: list[int],
             rng: random.Random, split: str, task_seed: int, phrasings: float) -> dict:
    """Instances `numbers` of `generate(split, ..., seed=task_seed)`, their windows, slips and
    misfixes drawn from `rng`, solved in `config.workers` processes; sequences saved to `out`."""
    windows = [rng.randint(*config.small_window) if rng.random() < config.summary_share
               else config.context_window for _ in numbers]
    slipped = [i for i in numbers if rng.random() < config.slip_share]
    misfixed = [i for i in numbers if rng.random() < config.misfix_share]
    k = max(1, min(len(numbers), config.workers or (os.cpu_count() or 2) - 1))
    chunks = [Chunk(str(tokenizer_dir), numbers[i::k], windows[i::k], task_seed, slipped,
                    misfixed, split, phrasings, config.grep_slips, config.mentions)
              for i in range(k)]
    if k == 1:
        parts = [_collect_chunk(chunks[0])]
    else:
        with ProcessPoolExecutor(k) as pool:
            parts = list(pool.map(_collect_chunk, chunks))
    seqs = [s for p in parts for s in p["seqs"]]
    save_sequences(out, seqs)
    stats = {key: sum(p[key] for p in parts) for key in ("episodes", "passed", "samples",
                                                         "merged", "summaries", "slips",
                                                         "misfixes", "misfix_dropped")}
    stats.update(sequences=len(seqs), tokens=sum(len(s[0]) for s in seqs),
                 trained_tokens=sum(sum(s[1]) for s in seqs))
    return stats


def save_sequences(path: Path, seqs: list[tuple[list[int], list[int]]]) -> None:
    lengths = np.array([len(ids) for ids, _ in seqs], dtype=np.int64)
    ids = np.array([t for s, _ in seqs for t in s], dtype=np.uint16)
    mask = np.array([m for _, ms in seqs for m in ms], dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, ids=ids, mask=mask, lengths=lengths)


def load_sequences(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    with np.load(path) as data:                   # each key access decompresses: read once
        ids, mask, lengths = data["ids"], data["mask"], data["lengths"]
    ends = np.cumsum(lengths)
    return [(ids[a:b], mask[a:b]) for a, b in zip(ends - lengths, ends)]


@torch.no_grad()
def assistant_metrics(model, seqs: list[tuple[np.ndarray, np.ndarray]], max_len: int = 4096,
                      device: str = "cpu") -> dict:
    """Loss and exact next tokens on the trained (assistant) tokens of `seqs`, one sequence
    at a time, each fed as the model reads it in training (cut at `max_len`): `loss` is the
    mean cross-entropy per token, `token_accuracy` the share of those tokens that are the
    model's argmax given the true prefix, `turns_exact` the share of assistant turns (runs of
    trained tokens) whose every token is."""
    model.eval()
    nll, right, tokens, turns, exact = 0.0, 0, 0, 0, 0
    for ids, mask in seqs:
        x, y, m = _padded([(ids, mask)], max_len, 0)
        if not m.any():
            continue
        logits = model(x.to(device), logits_at=m.to(device)).logits.float()      # [N, V]
        target = y[m].to(device)
        nll += float(F.cross_entropy(logits, target, reduction="sum"))
        hit = (logits.argmax(-1) == target).cpu()
        right, tokens = right + int(hit.sum()), tokens + len(target)
        # a turn is a run of trained positions; split the hits at the gaps between runs
        pos = m[0].nonzero()[:, 0]
        breaks = (pos[1:] != pos[:-1] + 1).nonzero()[:, 0] + 1
        for run in torch.tensor_split(hit, breaks):
            turns, exact = turns + 1, exact + int(run.all())
    return {"sequences": len(seqs), "tokens": tokens, "loss": nll / max(tokens, 1),
            "token_accuracy": right / max(tokens, 1), "turns": turns,
            "turns_exact": exact / max(turns, 1)}


# -- training -----------------------------------------------------------------------------------

Transform = Callable[[np.ndarray, np.ndarray, random.Random], tuple[np.ndarray, np.ndarray]]


def sequence_batches(seqs: list[tuple[np.ndarray, np.ndarray]], batch_size: int, max_len: int,
                     pad: int, seed: int, transform: Transform | None = None,
                     pack: bool = False) -> Callable[[int], tuple[torch.Tensor, ...] | Packed]:
    """batch(step): `batch_size` sequences drawn by (seed, step), right-padded, shifted by one;
    targets are trained only where the mask marks a completion token. With `pack`, packed
    into a prefix tree (`_packed`) instead of padded."""
    def batch(step: int):
        rng = random.Random(seed * 1_000_003 + step)
        picked = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        if pack:
            return _packed(picked, max_len, transform, rng)
        return _padded(picked, max_len, pad, transform, rng)
    return batch


def _padded(picked: list[tuple[np.ndarray, np.ndarray]], max_len: int, pad: int,
            transform: Transform | None = None, rng: random.Random | None = None
            ) -> tuple[torch.Tensor, ...]:
    """The picked sequences (each passed through `transform` with `rng` first, if given)
    right-padded (cut at `max_len`), as inputs, targets and the loss mask of the targets."""
    if transform is not None:
        picked = [transform(s, m, rng) for s, m in picked]
    T = min(max_len, max(len(ids) for ids, _ in picked)) - 1
    ids = torch.full((len(picked), T + 1), pad, dtype=torch.long)
    mask = torch.zeros(len(picked), T + 1, dtype=torch.bool)
    for b, (s, m) in enumerate(picked):
        n = min(len(s), T + 1)
        ids[b, :n] = torch.from_numpy(s[:n].astype(np.int64))
        mask[b, :n] = torch.from_numpy(m[:n].astype(bool))
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def _packed(picked: list[tuple[np.ndarray, np.ndarray]], max_len: int,
            transform: Transform | None = None, rng: random.Random | None = None) -> Packed:
    """The sequences `_padded` makes of `picked`, packed into one prefix tree (`Packed`): the
    positions they start with alike are fed once; the same trained tokens and loss."""
    from learner.trainer import _tree, packed_tree
    if transform is not None:
        picked = [transform(s, m, rng) for s, m in picked]
    cut = [(s[:max_len].astype(np.int64), m[:max_len].astype(bool)) for s, m in picked]
    fed = [s[:-1] for s, _ in cut]
    nodes, n = _tree([f[:, None] for f in fed])
    ids, positions, paths = packed_tree(fed, nodes, n)
    where = np.concatenate([nd[m[1:]] for nd, (_, m) in zip(nodes, cut)])
    targets = np.concatenate([s[1:][m[1:]] for s, m in cut])
    order = np.argsort(where, kind="stable")           # logits come in packed order
    where, targets = where[order], targets[order]
    at = np.zeros(n, dtype=bool)
    at[where] = True
    rows = None
    if len(np.unique(where)) < len(where):              # a shared position trained twice
        rows = torch.from_numpy(np.cumsum(at)[where] - 1)
    return Packed(ids[None], positions[None], Paths(*paths), torch.from_numpy(at)[None],
                  torch.from_numpy(targets), rows)


def length_batches(seqs: list[tuple[np.ndarray, np.ndarray]], batch_tokens: int, max_len: int,
                   pad: int, seed: int, transform: Transform | None = None, pack: bool = False
                   ) -> Callable[[int], tuple[torch.Tensor, ...] | Packed]:
    """batch(step): sequences of similar length (sorted, then cut into groups whose padded size
    stays within `batch_tokens`), groups in an order shuffled per epoch by (seed, epoch); each
    epoch shows every sequence once. Same output as `sequence_batches`; with `pack`, the group
    packed into a prefix tree (`_packed`) instead of padded."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    groups: list[list[int]] = []
    for i in order:
        n = min(len(seqs[i][0]), max_len)
        if groups and (len(groups[-1]) + 1) * n <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])

    def batch(step: int):
        epoch, k = divmod(step, len(groups))
        perm = list(range(len(groups)))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        picked, rng = [seqs[i] for i in groups[perm[k]]], random.Random(seed * 1_000_003 + step + 1)
        if pack:
            return _packed(picked, max_len, transform, rng)
        return _padded(picked, max_len, pad, transform, rng)
    return batch


def _augmenting(tok, seqs: list[tuple[np.ndarray, np.ndarray]], config: SFTConfig
                ) -> Transform | None:
    """Rename a `config.rename` share of the sequences, then noise the task of a
    `config.instruction_noise` share and open the task of a `config.preamble` share with a
    sentence (`learner.recipe.augment`); the words of the episodes' shared system turn (the
    harness: tool and argument names) are never renamed. None when none is asked for."""
    from learner.recipe.augment import InstructionNoise, Preamble, Renamer

    if not config.rename and not config.instruction_noise and not config.preamble:
        return None
    ids = seqs[0][0].tolist()
    harness = tok.decode(ids[:ids.index(tok.special_tokens["<|im_end|>"])])
    renamer = Renamer(tok, harness, merge=config.rename_merge)
    noise = InstructionNoise(renamer, config.noise_rate)
    preamble = Preamble(renamer)

    def transform(ids: np.ndarray, mask: np.ndarray, rng: random.Random):
        if rng.random() < config.rename:
            ids, mask = renamer(ids, mask, rng)
        if config.instruction_noise and rng.random() < config.instruction_noise:
            ids, mask = noise(ids, mask, rng)
        if config.preamble and rng.random() < config.preamble:
            ids, mask = preamble(ids, mask, rng)
        return ids, mask
    return transform


def copy_sequences(tok, seqs: list[tuple[np.ndarray, np.ndarray]], share: float, seed: int
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Copy windows (`pretrain.copy_window`: random spans written twice, trained on the second
    copy) as many as make `share` of the training set, each as long as an episode drawn at
    random: they keep asking for the copying the episodes need (a name from the task, an `old`
    string from the file just read) in isolation from everything else."""
    from learner.recipe.pretrain import copy_window
    n = round(len(seqs) * share / (1 - share))
    ids = torch.tensor(sorted(set(range(tok.vocab_size)) - set(tok.special_tokens.values())))
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        row, mask = copy_window(ids, len(seqs[rng.randrange(len(seqs))][0]), g)
        out.append((row.numpy().astype(np.uint16), mask.numpy().astype(np.uint8)))
    return out


def _episodes_only(transform: Transform | None, start: int) -> Transform | None:
    """`transform` for the episodes (which begin with the token `start`); copy windows pass."""
    if transform is None:
        return None

    def apply(ids: np.ndarray, mask: np.ndarray, rng: random.Random):
        return transform(ids, mask, rng) if ids[0] == start else (ids, mask)
    return apply


def run(start_dir: Path, data: Path | Sequence[Path], out: Path, config: SFTConfig,
        log: Callable[[dict], None] = print) -> dict:
    """Fine-tune the checkpoint in `start_dir` on `data` (one or more files `collect` wrote);
    write `out/model`."""
    from agent_runtime.model import load_model, load_tokenizer, save_model
    from learner.recipe.pretrain import MAX_SHARD_BYTES, copy_tokenizer, pick_device

    device = pick_device(config.device)
    tok = load_tokenizer(start_dir)
    model = load_model(start_dir, dtype="float32")
    files = [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]
    seqs = [s for f in files for s in load_sequences(f)]
    if not seqs:
        raise ValueError(f"{', '.join(map(str, files))}: no SFT sequences")
    pad = tok.special_tokens["<|endoftext|>"]
    transform = _augmenting(tok, seqs, config)
    if config.copy_share:
        transform = _episodes_only(transform, tok.special_tokens["<|im_start|>"])
        seqs = seqs + copy_sequences(tok, seqs, config.copy_share, config.seed)
    if config.batch_tokens:
        batch = length_batches(seqs, config.batch_tokens, config.max_len, pad, config.seed,
                               transform, config.share_prefix)
    else:
        batch = sequence_batches(seqs, config.batch_size, config.max_len, pad, config.seed,
                                 transform, config.share_prefix)
    result = train_lm(model, batch, config.train, out / "state", device, log=log)
    model.to("cpu")
    if config.mentions:                         # EnginePolicy.mentions: the loop adds the block
        model.hf_config[MENTIONS_KEY] = True
    save_model(model, out / "model", dtype="bfloat16", max_shard_bytes=MAX_SHARD_BYTES)
    copy_tokenizer(start_dir, out / "model")
    return {"sequences": len(seqs), "device": device, "seconds": result["seconds"],
            "steps": result["steps"], "final_loss": (result["history"] or [{}])[-1].get("loss"),
            "history": result["history"], "config": asdict(config)}
