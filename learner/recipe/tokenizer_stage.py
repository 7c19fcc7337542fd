"""Stage 1 of the recipe: the code corpus and a byte-level BPE trained on it, in tiktoken format.

The corpus is the Python source available offline on any machine that runs apprentice: the
interpreter's standard library and the installed packages (`sysconfig` paths). Files are taken
in a fixed order (sorted relative paths under named roots) and split into train / held-out by a
hash of the relative path, so the same installation gives the same corpus and split.

`train_bpe` learns byte-level BPE merges over pre-tokenized word counts (the words are what the
tokenizer's own split regex, `CODE_PAT_STR` below, cuts the text into, as tiktoken does before
merging): a heap of pair counts with lazy invalidation and a pair -> words index, so each merge
touches only the words that contain the pair. Merge i becomes rank 256 + i, which is what
tiktoken applies.
Chat and tool-call markers are added tokens (not learned), the way Qwen2.5 has them.

It does not read HF `tokenizers` files or use that library; loading is `load_tokenizer`'s job.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import regex

from agent_runtime.model.tokenizer import AddedToken, Tokenizer, _make_encoding

# Added tokens, in id order after the merges: ChatML specials, then the tool-call markers
# (non-special, so plain `encode` always matches them, as Qwen2.5's tokenizer does).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MAX_WORD_BYTES = 64            # longer pre-tokenized words are left out of the merge counts

# The recipe's pre-tokenizer: Qwen2's split (DEFAULT_PAT_STR) with one change, punctuation
# never joins a word. Qwen2's `[^\r\n\p{L}\p{N}]?\p{L}+` lets a word take one leading
# character, so `/availability`, `.availability` and `.py` are words of their own, and the
# same name is unrelated tokens in a path (`rota/availability.py`), a module
# (`rota.availability`) and a relative import (` .` `a` `vailability`): writing the import of
# a file the search found was spelling, not a copy. Here a word is an optional space and
# letters or underscores (an identifier is one word, its pieces left to the merges), and
# punctuation stays in runs of its own: a name is the same ids wherever it appears. On the
# recipe's corpus: 3.13 bytes a token on held-out code against 3.26.
CODE_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)| ?[\p{L}_]+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}_]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# An alternative (`r15`, not the default): code inside a tool call is a JSON string, so its line
# breaks are the two characters `\n`, and CODE_PAT_STR's punctuation runs take a line break
# with them (`):` + newline one word) and a backslash too (`):\` `n`, then `\ndef`): a line
# copied from a file into an edit's `old` is a different token sequence from the same code in
# the file (80 tokens against 43 for a 7-line function). ESCAPE_PAT_STR makes an escape (`\n`,
# `\"`, `\t`, `\\`) a word of its own and lets punctuation take no line break, so escaped code
# is the file's tokens with each newline one `\n` (7.8 % more words on library code). `r15`
# used it and scored as `r13` did (README, "Runs after `r13`").
ESCAPE_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|\\[nrt"\\]| ?[\p{L}_]+|\p{N}"""
                  r"""| ?[^\s\p{L}\p{N}_\\]+|\\|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass
class TokenizerConfig:
    vocab_size: int = 8192          # total ids: 256 bytes + merges + added tokens
    train_bytes: int = 24_000_000   # corpus bytes whose words are counted for the merges
    heldout_percent: int = 2        # share of files (by path hash) kept out for perplexity
    max_file_bytes: int = 400_000   # larger files (generated tables, data) are skipped
    pat_str: str = CODE_PAT_STR     # pre-tokenizer regex (tiktoken dialect)
    task_repos: int = 0             # solved simulated training repositories counted beside
                                    # the library code (`task_corpus`, as pre-training adds)
    task_seed: int = 0              # ... drawn with this seed


# -- corpus -------------------------------------------------------------------------------------

def source_roots() -> dict[str, Path]:
    """Named roots of offline Python source: the standard library and installed packages."""
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"]), "purelib": Path(paths["purelib"])}
    if Path(paths["platlib"]) != roots["purelib"]:
        roots["platlib"] = Path(paths["platlib"])
    return roots


def corpus_files(roots: dict[str, Path] | None = None, max_file_bytes: int = 400_000
                 ) -> list[tuple[str, Path]]:
    """(name, path) of every `.py` file under the roots, sorted by name; a file reachable
    from two roots (a venv inside the stdlib folder) is listed once, under the first."""
    roots = roots or source_roots()
    seen: set[Path] = set()
    out = []
    for label, root in roots.items():
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            try:
                real = path.resolve()
                if real in seen or not path.is_file() or path.stat().st_size > max_file_bytes:
                    continue
            except OSError:
                continue
            seen.add(real)
            out.append((f"{label}/{path.relative_to(root).as_posix()}", path))
    return sorted(out, key=lambda item: _order(item[0]))


def _order(name: str) -> str:
    """A fixed pseudo-random order, so a byte budget samples every package, not the first."""
    return hashlib.sha256(name.encode()).hexdigest()


def is_heldout(name: str, percent: int) -> bool:
    return int(hashlib.sha256(b"split:" + name.encode()).hexdigest(), 16) % 100 < percent


def read_texts(files: Iterable[tuple[str, Path]], budget: int | None = None
               ) -> Iterator[tuple[str, str]]:
    """(name, text) of UTF-8 decodable files, until `budget` bytes have been yielded."""
    used = 0
    for name, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        yield name, text
        used += len(text.encode("utf-8"))
        if budget is not None and used >= budget:
            return


# -- BPE ----------------------------------------------------------------------------------------

def word_counts(texts: Iterable[str], pat_str: str = CODE_PAT_STR) -> Counter[bytes]:
    """How often each pre-tokenized word (as UTF-8 bytes) occurs."""
    pattern = regex.compile(pat_str)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(w.encode("utf-8") for w in pattern.findall(text))
    return counts


def train_bpe(counts: dict[bytes, int], n_merges: int) -> dict[bytes, int]:
    """Mergeable ranks (bytes -> rank): the 256 bytes, then up to `n_merges` learned tokens.

    Each step merges the most frequent adjacent pair (ties: the pair whose bytes sort first,
    so the result does not depend on how ids were assigned). A merge whose
    bytes already form a token (reached by another split) reuses that token's id."""
    ranks = {bytes([b]): b for b in range(256)}
    vocab = [bytes([b]) for b in range(256)]                 # id -> bytes
    words = [list(w) for w in counts if 1 < len(w) <= MAX_WORD_BYTES]
    freq = [counts[bytes(w)] for w in words]
    pairs: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, vocab[p[0]], vocab[p[1]], p) for p, c in pairs.items()]
    heapq.heapify(heap)
    learned = 0
    while learned < n_merges and heap:
        neg, _, _, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -neg or neg == 0:
            continue                                         # stale entry
        merged = vocab[pair[0]] + vocab[pair[1]]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = ranks[merged] = len(vocab)
            vocab.append(merged)
            learned += 1
        touched: set[tuple[int, int]] = set()
        for i in where.pop(pair, ()):
            w, f = words[i], freq[i]
            if not any(a == pair[0] and b == pair[1] for a, b in zip(w, w[1:])):
                continue
            for p in zip(w, w[1:]):
                pairs[p] -= f
                touched.add(p)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == pair[0] and w[j + 1] == pair[1]:
                    out.append(new_id)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pairs[p] += f
                touched.add(p)
                where.setdefault(p, set()).add(i)
        pairs.pop(pair, None)
        for p in touched:
            c = pairs.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, vocab[p[0]], vocab[p[1]], p))
            else:
                pairs.pop(p, None)
    return ranks


def build_tokenizer(ranks: dict[bytes, int], pat_str: str = CODE_PAT_STR) -> Tokenizer:
    """Our `Tokenizer` over learned ranks, with the ChatML and tool-call tokens added."""
    first = max(ranks.values()) + 1
    names = SPECIAL_TOKENS + MARKER_TOKENS
    added = [AddedToken(t, first + i, special=t in SPECIAL_TOKENS) for i, t in enumerate(names)]
    ids = {t.content: t.id for t in added}
    encoding, _ = _make_encoding("apprentice", pat_str, ranks, added, None)
    return Tokenizer(encoding, added_tokens=added, eos_token_id=ids["<|im_end|>"],
                     pad_token_id=ids["<|endoftext|>"])


def tokenizer_config(tok: Tokenizer, chat_template: str) -> dict:
    """tokenizer_config.json: the chat template and named special tokens (transformers' keys)."""
    return {
        "chat_template": chat_template,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 4096,
        "added_tokens_decoder": {str(t.id): {"content": t.content, "special": t.special,
                                             "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False}
                                 for t in tok.added_tokens},
    }


def save_tokenizer(tok: Tokenizer, directory: Path, chat_template: str) -> Path:
    tok.save(directory)
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tok, chat_template), indent=1) + "\n", encoding="utf-8")
    return directory


def run(out: Path, config: TokenizerConfig, files: list[tuple[str, Path]] | None = None) -> dict:
    """Train the tokenizer on the train split of the corpus (and `config.task_repos` solved
    task repositories); write it to `out`; return metrics."""
    from agent_runtime.model.chat_template import COMPACT_CHAT_TEMPLATE

    files = files if files is not None else corpus_files(max_file_bytes=config.max_file_bytes)
    train = [(n, p) for n, p in files if not is_heldout(n, config.heldout_percent)]
    texts = [t for _, t in read_texts(train, config.train_bytes)]
    if config.task_repos:
        from learner.recipe.task_corpus import repo_texts
        texts += [t for _, t in repo_texts(config.task_repos, seed=config.task_seed)]
    counts = word_counts(texts, config.pat_str)
    n_merges = config.vocab_size - 256 - len(SPECIAL_TOKENS) - len(MARKER_TOKENS)
    ranks = train_bpe(counts, n_merges)
    tok = build_tokenizer(ranks, config.pat_str)
    save_tokenizer(tok, out, COMPACT_CHAT_TEMPLATE)   # the harness we train in
    heldout = [t for _, t in read_texts([(n, p) for n, p in files
                                         if is_heldout(n, config.heldout_percent)], 1_000_000)]
    n_bytes = sum(len(t.encode("utf-8")) for t in heldout)
    n_tokens = sum(len(tok.encode(t, special=False)) for t in heldout)
    return {"vocab_size": tok.vocab_size, "merges": len(ranks) - 256,
            "train_files": len(texts), "train_bytes": sum(len(t.encode()) for t in texts),
            "unique_words": len(counts),
            "heldout_bytes_per_token": round(n_bytes / max(n_tokens, 1), 3)}
