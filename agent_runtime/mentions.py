"""Where the names a task mentions live: a few lines the runtime appends to the task.

A user names code in their own words: "`count_hours_above([10, 0], 10)` gives 2", "TODO
left in `shiftplan/timesheets.py`: count_hours_above does nothing yet", "`total` must become
`compute_total`". Which of those words is the function to open, and which name does not
exist yet, is what a small model gets wrong when the wording is new to it (it learns "the
first backticked span is the function" from the sentences it was trained on). Aider ranks
its repository map by the identifiers the user's message mentions; we go one step further
and tell the model where they are, in one fixed format whatever the wording:

    Names in the task:
    `count_hours_above`: def in shiftplan/timesheets.py:4
    `compute_total`: not in the code

Names the workspace defines (`def` or `class` in a `.py` file) come first, in the order
the task mentions them, then backticked names it does not define. Values (`1`, `'abc'`),
keywords and builtins are left out; so is the whole block when nothing is found.

A checkpoint trained with the block says so in its config (`"apprentice_mentions": true`)
and the agent loop adds it for that policy only (`AgentConfig.mentions`); other models see
the task as the user wrote it. This module reads files and nothing else: it walks the
workspace as the search tools do (`tools.paths.walk`), runs no command and does not resolve
imports or call sites.
"""

from __future__ import annotations

import builtins
import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from agent_runtime.tools import paths

CONFIG_KEY = "apprentice_mentions"             # config.json: the checkpoint was trained with it
HEADER = "Names in the task:"
MAX_NAMES = 6                                  # lines in the block at most
MAX_FILES = 5000                               # .py files scanned in one workspace
MAX_FILE_BYTES = 512 * 1024                    # longer files are skipped

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SPAN = re.compile(r"`([^`\n]+)`")
DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_][A-Za-z0-9_]*)", re.M)
COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "pytest", "python"}


@dataclass(frozen=True)
class Mention:
    name: str
    where: str | None                          # "path:line" of its first definition, or None
    more: int = 0                              # other definitions of the same name

    def line(self) -> str:
        if self.where is None:
            return f"`{self.name}`: not in the code"
        return f"`{self.name}`: def in {self.where}" + (f" (+{self.more} more)" if self.more else "")


def definitions(files: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """name -> ["path:line", ...] for every `def` and `class` in the given (path, text)
    pairs; files under tests/ (or named test_*.py) after the others."""
    found: dict[str, list[str]] = {}
    ordered = sorted(files, key=lambda f: (_is_test(f[0]), f[0]))
    for path, text in ordered:
        if not path.endswith(".py"):
            continue
        for m in DEF.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.setdefault(m.group(1), []).append(f"{path}:{line}")
    return found


def workspace_files(root: str | Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) of the workspace's `.py` files, as the search tools walk it
    (`paths.walk`: no `.git`, virtualenvs, `node_modules` or .gitignored files); at most
    MAX_FILES files of at most MAX_FILE_BYTES."""
    root = Path(root)
    count = 0
    for path in paths.walk(root):
        if path.suffix != ".py":
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        yield paths.display(root, path), text
        count += 1
        if count >= MAX_FILES:
            return


def mentions(task: str, defs: dict[str, list[str]]) -> list[Mention]:
    """The names `task` mentions: the defined ones first (task order), then backticked
    names that are not defined; at most MAX_NAMES."""
    spans = SPAN.findall(task)
    whole = [s.strip() for s in spans if IDENT.fullmatch(s.strip())]
    seen: set[str] = set()
    defined: list[Mention] = []
    for word in IDENT.findall(task):
        if word in seen or word in COMMON:
            continue
        seen.add(word)
        if word in defs:
            defined.append(Mention(word, defs[word][0], len(defs[word]) - 1))
    missing = [Mention(w, None) for w in dict.fromkeys(whole) if w not in defs and w not in COMMON]
    return (defined + missing)[:MAX_NAMES]


def block(task: str, files: Iterable[tuple[str, str]]) -> str:
    """The lines to append to the task ("" when it mentions nothing the lookup knows)."""
    found = mentions(task, definitions(files))
    if not any(m.where for m in found):
        return ""
    return "\n".join([HEADER] + [m.line() for m in found])


def with_mentions(task: str, files: Iterable[tuple[str, str]]) -> str:
    """The task followed by its block, after a blank line (the task alone when empty)."""
    text = block(task, files)
    return f"{task}\n\n{text}" if text else task


def _is_test(path: str) -> bool:          # learner.tasks.grading.is_test_file's rule, minus
                                          # `*_test.py` (the runtime does not import the learner)
    parts = path.split("/")
    return "tests" in parts[:-1] or "test" in parts[:-1] or parts[-1].startswith("test_")
