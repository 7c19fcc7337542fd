"""Renaming augmentation for SFT sequences: the domain's words replaced by fresh ones.

The simulated repositories draw their names (packages, modules, quantities, parameter names)
from ten small training domains (`learner.tasks.vocab`). A small model trained on a few
thousand such episodes learns the cheap answer first: recall a familiar name (`gradebook`,
`stock_levels`) instead of reading the one the task and the tool results give it, which is
useless on the held-out domains. Here every training sequence can be seen with its domain
words consistently replaced, across the whole episode (task, tool results, the model's own
calls), by words the model has no reason to expect, so the only way to write the right
path or identifier is to copy it from the context.

A word is renamed where it stands alone or as one `_`-separated part of an identifier
(`serving` in `serving_stdev`), everywhere in the sequence, so the episode stays consistent:
the renamed repository is one the oracle could have solved the same way. Words that are also
Python keywords, builtins, standard-library modules or part of the harness (tool names,
argument names, the system prompt) are never renamed, nor are held-out domains' words used
as replacements.

Names that look alike. With `merge`, a share of the renamed sequences also gives two of the
episode's domain words the same replacement (the package and the data file become `orders`
and `orders.csv`): a model that copies by the last few tokens alone then writes `python -m
orders.cli orders.cli` (the nearest `orders.c` was followed by `li`); the episode asks it to
tell such names apart by more of their context.

It does not generate episodes (`learner.recipe.sft.collect` does) or touch the stored data:
renaming happens per batch, drawn from the batch's seed.
"""

from __future__ import annotations

import builtins
import keyword
import random
import re
import sys
from typing import Callable

import numpy as np

from agent_runtime.mentions import HEADER as MENTIONS_HEADER
from learner.tasks.vocab import DOMAINS

# generic words in the domains' names that also carry meaning outside a domain: kept
_KEEP = frozenset({"name", "text", "line", "note", "label", "summary", "title", "count",
                   "counts", "step", "steps", "point", "points", "result", "results", "score",
                   "scores", "reference", "description", "comment", "caption", "sessions",
                   "tokens", "metrics", "documents", "progress", "daily", "sentence",
                   "packages", "tracking", "activity", "goals", "shopping", "prep", "break",
                   "length", "lengths", "sum", "data", "tools", "util", "reports"})


def _parts(names) -> set[str]:
    return {p for n in names for p in n.split("_") if len(p) >= 3}


def domain_words(heldout: bool = False) -> set[str]:
    """Every word of the training domains' names (or of the held-out ones)."""
    words: set[str] = set()
    for d in DOMAINS:
        if d.heldout != heldout:
            continue
        words |= _parts(d.packages) | _parts(d.modules) | _parts(d.texts)
        for q in d.quantities:
            words |= _parts([q.plural, q.singular])
    return words


def _reserved(harness_text: str) -> set[str]:
    return (set(keyword.kwlist) | set(dir(builtins)) | set(sys.stdlib_module_names)
            | set(re.findall(r"[a-z]+", harness_text.lower())) | _KEEP)


class Renamer:
    """Renames the training domains' words in token sequences (see the module docstring).

    `pool` is the replacement words: lower-case alphabetic words of the tokenizer's own
    vocabulary (so a replacement costs few tokens), minus every reserved and domain word."""

    def __init__(self, tokenizer, harness_text: str = "", pool=None, min_len: int = 3,
                 max_len: int = 10, merge: float = 0.0):
        self.tokenizer = tokenizer
        self.merge = merge                   # share of sequences with two words made one
        reserved = _reserved(harness_text)
        self.words = sorted(domain_words() - reserved, key=lambda w: (-len(w), w))
        banned = reserved | domain_words() | domain_words(heldout=True)
        if pool is None:
            pool = (tokenizer.decode([i]).strip() for i in range(tokenizer.vocab_size))
        self.pool = sorted({p for p in pool if p.isascii() and p.isalpha() and p.islower()
                            and min_len <= len(p) <= max_len and p not in banned})
        if len(self.pool) < 2 * len(self.words):
            raise ValueError(f"tokenizer offers {len(self.pool)} replacement words for "
                             f"{len(self.words)} domain words")
        self._pattern = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(map(re.escape, self.words))
                                   + r")(?![A-Za-z0-9])")

    def mapping(self, rng: random.Random, avoid: set[str] = frozenset()) -> dict[str, str]:
        """A fresh one-to-one map of every domain word (one or two pool words joined by `_`),
        to words not in `avoid` (the words already in the sequence)."""
        taken: set[str] = set(avoid)
        out = {}
        for w in self.words:
            while True:
                new = rng.choice(self.pool)
                if rng.random() < 0.3:
                    new += "_" + rng.choice(self.pool)
                parts = new.split("_")
                if not taken.intersection(parts) and len(set(parts)) == len(parts):
                    break
            taken.update(parts)
            out[w] = new
        return out

    def text(self, text: str, mapping: dict[str, str]) -> str:
        return self._pattern.sub(lambda m: mapping.get(m.group(1), m.group(1)), text)

    def runs(self, ids: np.ndarray, mask: np.ndarray) -> list[tuple[str, bool]]:
        """The text of each run of equal mask values, and whether it is trained."""
        edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
        return [(self.tokenizer.decode(ids[a:b].tolist()), bool(mask[a]))
                for a, b in zip(np.r_[0, edges], np.r_[edges, len(ids)])]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, rng: random.Random
                 ) -> tuple[np.ndarray, np.ndarray]:
        """`ids` with its domain words renamed by a map drawn from `rng` (avoiding every word
        already in the sequence), and the loss mask carried over."""
        runs = self.runs(ids, mask)
        avoid = {w for text, _ in runs for w in re.findall(r"[a-z]+", text.lower())}
        mapping = self.mapping(rng, avoid)
        if self.merge and rng.random() < self.merge:
            present = sorted({m for text, _ in runs for m in self._pattern.findall(text)})
            if len(present) >= 2:
                a, b = rng.sample(present, 2)
                mapping[b] = mapping[a]
        return self.rename(runs, mapping, ids.dtype, mask.dtype)

    def rename(self, runs: list[tuple[str, bool]], mapping: dict[str, str], ids_dtype=np.int64,
               mask_dtype=np.bool_) -> tuple[np.ndarray, np.ndarray]:
        """The runs renamed by `mapping`, each encoded on its own (runs start and end at special
        tokens, so their tokenization does not interact), with the mask carried over."""
        out_ids: list[int] = []
        out_mask: list[bool] = []
        for text, trained in runs:
            run = self.tokenizer.encode(self.text(text, mapping))
            out_ids += run
            out_mask += [trained] * len(run)
        return np.asarray(out_ids, dtype=ids_dtype), np.asarray(out_mask, dtype=mask_dtype)


# -- instruction noise -------------------------------------------------------------------------

USER_TURN = "<|im_start|>user\n"
END_TURN = "<|im_end|>"
_PLAIN_WORD = re.compile(r"(?<![\w./`-])[A-Za-z]+(?![\w./`-])")


def task_start(sequence: str) -> int:
    """Where the first user turn's text begins in `sequence`, or -1 when it has none."""
    start = sequence.find(USER_TURN)
    return start if start < 0 else start + len(USER_TURN)


def edit_task(renamer: Renamer, ids: np.ndarray, mask: np.ndarray,
              edit: Callable[[str, str], str]) -> tuple[np.ndarray, np.ndarray]:
    """`ids` with the run the task sits in (the first untrained one, as `Renamer.runs` splits
    them) replaced by `edit(its text, the text after it)`, each run encoded on its own, the
    loss mask carried over; `ids` and `mask` themselves when there is no such run or the edit
    changes nothing."""
    runs = renamer.runs(ids, mask)
    first = next((k for k, (_, trained) in enumerate(runs) if not trained), None)
    if first is None:
        return ids, mask
    text = runs[first][0]
    new = edit(text, "".join(t for t, _ in runs[first + 1:]))
    if new == text:
        return ids, mask
    runs[first] = (new, False)
    return renamer.rename(runs, {}, ids.dtype, mask.dtype)


class InstructionNoise:
    """Replaces a share of the plain words of an episode's task with random words.

    The held-out tasks are worded in sentences no training task uses, and a small model
    trained on a few wordings per family reads the family off the wording: on "We are
    standardising names in cookbook. `serving_stdev` must become `stdev_of_servings`" the
    shipped model searched for `stdev_of_servings`, the new name, and never renamed anything.
    With some of the wording replaced by noise, the episode can only be played from what the
    noise leaves: the backticked names, paths and commands, the words the rest of the
    episode repeats (a package's name, an error), and what the tools then show (which name
    the code defines). Only the first user turn's task is touched (not the mention block,
    not the harness), and a word is kept whenever it occurs again after the task, so every
    replaced word is one the episode never refers to."""

    def __init__(self, renamer: Renamer, rate: float = 0.5):
        self.renamer, self.rate = renamer, rate

    def text(self, sequence: str, rng: random.Random, after: str = "") -> str:
        """`sequence` with the plain words of its first user turn's task noised; `after`: the
        text that follows `sequence` in the episode (words it repeats are kept)."""
        start = task_start(sequence)
        if start < 0:
            return sequence
        end = sequence.find(END_TURN, start)
        end = len(sequence) if end < 0 else end
        task_end = sequence.find("\n\n" + MENTIONS_HEADER, start, end)
        task_end = end if task_end < 0 else task_end
        later = {w.lower() for w in re.findall(r"[A-Za-z]+", sequence[task_end:] + after)}

        def noise(m: re.Match) -> str:
            word = m.group(0)
            if word.lower() in later or rng.random() >= self.rate:
                return word
            return rng.choice(self.renamer.pool)

        parts = re.split(r"(`[^`]*`)", sequence[start:task_end])
        task = "".join(p if p.startswith("`") else _PLAIN_WORD.sub(noise, p) for p in parts)
        return sequence[:start] + task + sequence[task_end:]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, rng: random.Random
                 ) -> tuple[np.ndarray, np.ndarray]:
        """`ids` with its task's words noised (`edit_task`), the loss mask carried over."""
        return edit_task(self.renamer, ids, mask,
                         lambda text, after: self.text(text, rng, after))


# -- preambles ---------------------------------------------------------------------------------

# Sentences a user puts before the request itself (none names a task family or a plan)
OPENERS = ("Hi!", "Hello.", "Hi there.", "Morning!", "Quick one:", "Small request.",
           "Next item:", "Ticket:", "One more thing.", "Here is what I need.", "Some housekeeping.",
           "A request from the team.", "Follow-up from yesterday.", "Low priority, but today.",
           "When you have a minute:", "Thanks in advance.", "Please read carefully.",
           "From the backlog:", "Another one for you.", "Context: this came up in review.")


class Preamble:
    """Puts a sentence before the task of the first user turn: one of `OPENERS`, or a few
    random words from the renamer's pool.

    A held-out wording can open with a sentence of its own before it names anything: "We are
    standardising names in cookbook. `serving_stdev` must become `stdev_of_servings`". The
    shipped model, asked for the first search of that task (its next tokens after "Let me find
    `"), prefers the new name by 8.9 nats on average over 6 tasks, and so it does after *any*
    sentence put before a "`a` must become `b`" or a training wording "`a` should be called
    `b`" ("Hi." included: -10 and -13 nats), where without one it prefers the old name (+3.6
    and +3.3). The training wordings that open with text before the first name are mostly the
    ones naming the new name first ("The name `b` should replace `a`"), so the model learned
    where the old name stands, not what the sentence says. With a share of the training tasks
    opened by a sentence that says nothing about the task, where a name stands after an
    opening no longer tells which it is. Measured (README, "Where a name stands"): at 0.3 from
    the start of SFT the first search took the old name in 9 of 16 probed tasks (2 before),
    but the `sed` after it lost the new name (0 of 9 teacher-forced, the shipped model 8):
    the model also finds the second name by its position. Off by default."""

    def __init__(self, renamer: Renamer, openers: tuple[str, ...] = OPENERS,
                 words: float = 0.5):
        self.renamer, self.openers, self.words = renamer, openers, words

    def sentence(self, rng: random.Random) -> str:
        """An opener, or (a `words` share of the time) 2-6 pool words as a sentence."""
        if rng.random() >= self.words:
            return rng.choice(self.openers)
        words = [rng.choice(self.renamer.pool) for _ in range(rng.randint(2, 6))]
        return " ".join(words).capitalize() + rng.choice(".:!")

    def text(self, sequence: str, rng: random.Random) -> str:
        """`sequence` with a sentence before its first user turn's text."""
        start = task_start(sequence)
        if start < 0:
            return sequence
        return sequence[:start] + self.sentence(rng) + " " + sequence[start:]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, rng: random.Random
                 ) -> tuple[np.ndarray, np.ndarray]:
        """`ids` with a preamble before its task (`edit_task`), the loss mask carried over."""
        return edit_task(self.renamer, ids, mask, lambda text, _after: self.text(text, rng))
