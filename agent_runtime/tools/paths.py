"""Workspace paths for the built-in tools: confinement, ignore rules, globbing, text sniffing.

Every path a tool touches goes through `resolve()`, which refuses anything that ends up
outside the workspace root, whether through `..`, an absolute path or a symlink. An absolute
path under `/workspace` (where sandboxed commands see the workspace, so what tracebacks and
test reports name) is that path of the workspace. `walk()`
yields workspace files in a stable order, skipping what a developer would not want searched
(`.git`, `__pycache__`, virtualenvs, `node_modules`, and what `.gitignore` files name).

This module does not read file contents beyond the small prefix `is_binary` needs, and it
does not try to be a complete gitignore implementation: plain patterns, `dir/`, anchored
`/pattern`, `**` and `!negation` are supported; git's escapes and global excludes are not.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from agent_runtime.sandbox import MOUNT
from agent_runtime.tools.base import ToolError

# Directories never listed or searched, whatever .gitignore says.
ALWAYS_SKIP = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".tox", ".nox", ".idea", ".eggs", ".apprentice",
})

SNIFF_BYTES = 8192


def resolve(workspace: Path, path: str, *, tool: str = "") -> Path:
    """The absolute, symlink-free path for `path` (relative to the workspace, absolute inside
    it, or under `/workspace`, the sandbox's name for it). Raises ToolError when it would
    leave the workspace."""
    prefix = f"{tool}: " if tool else ""
    if "\x00" in path:
        raise ToolError(f"{prefix}path contains a NUL byte")
    root = Path(os.path.realpath(workspace))
    raw = Path(path.strip() or ".")
    if raw.is_absolute() and (raw == Path(MOUNT) or Path(MOUNT) in raw.parents) \
            and not _inside(root, Path(os.path.normpath(raw))):
        raw = raw.relative_to(MOUNT)
    candidate = raw if raw.is_absolute() else root / raw
    real = Path(os.path.realpath(candidate))
    if real != root and root not in real.parents:
        via = " (through a symlink)" if _inside(root, Path(os.path.normpath(candidate))) else ""
        raise ToolError(f"{prefix}`{path}` is outside the workspace{via}; "
                        "use a path relative to the workspace root")
    return real


def _inside(root: Path, p: Path) -> bool:
    return p == root or root in p.parents


def display(workspace: Path, path: Path) -> str:
    """`path` relative to the workspace root, with forward slashes ('.' for the root)."""
    root = Path(os.path.realpath(workspace))
    try:
        rel = Path(os.path.realpath(path)).relative_to(root)
    except ValueError:
        return str(path)
    return rel.as_posix() or "."


def is_binary(prefix: bytes) -> bool:
    """Git's heuristic: a NUL byte in the first few KiB means binary."""
    return b"\x00" in prefix[:SNIFF_BYTES]


def sniff(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(SNIFF_BYTES)


# ---------------------------------------------------------------- globbing

@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1:end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end + 1
        elif c == "{":
            end = pattern.find("}", i + 1)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                alts = pattern[i + 1:end].split(",")
                out.append("(?:" + "|".join(_glob_regex(a).pattern[:-2] for a in alts) + ")")
                i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(rel: str, pattern: str) -> bool:
    """Match a workspace-relative posix path against a glob. A pattern without '/' matches
    the file name at any depth (`*.py`); with '/', the whole path (`src/**/test_*.py`)."""
    pattern = pattern.strip()
    while pattern.startswith("./"):
        pattern = pattern[2:]
    if "/" not in pattern:
        return bool(_glob_regex(pattern).match(rel.rsplit("/", 1)[-1]))
    return bool(_glob_regex(pattern.lstrip("/")).match(rel))


# ---------------------------------------------------------------- ignore rules

@dataclass(frozen=True)
class _Rule:
    base: str          # directory (relative, '' for root) holding the .gitignore
    pattern: str
    negate: bool
    dir_only: bool
    anchored: bool


def _parse_gitignore(text: str, base: str) -> list[_Rule]:
    rules = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        line = line.lstrip("/")
        if line:
            rules.append(_Rule(base, line, negate, dir_only, anchored))
    return rules


def _rule_matches(rule: _Rule, rel: str, is_dir: bool) -> bool:
    if rule.dir_only and not is_dir:
        return False
    if rule.base:
        if not rel.startswith(rule.base + "/"):
            return False
        rel = rel[len(rule.base) + 1:]
    if rule.anchored:
        return bool(_glob_regex(rule.pattern).match(rel))
    return fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], rule.pattern)


class Ignore:
    """Accumulates .gitignore rules while walking down from the workspace root."""

    def __init__(self, root: Path):
        self.root = root
        self.rules: list[_Rule] = []
        self._seen: set[str] = set()

    def load_dir(self, rel_dir: str) -> None:
        if rel_dir in self._seen:
            return
        self._seen.add(rel_dir)
        f = self.root / rel_dir / ".gitignore"
        if f.is_file():
            try:
                self.rules.extend(_parse_gitignore(f.read_text(errors="replace"), rel_dir))
            except OSError:
                pass

    def ignored(self, rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if is_dir and (name in ALWAYS_SKIP or name.endswith(".egg-info")):
            return True
        verdict = False
        for rule in self.rules:
            if rule.negate == verdict and _rule_matches(rule, rel, is_dir):
                verdict = not rule.negate
        return verdict


def walk(workspace: Path, start: Path | None = None) -> Iterator[Path]:
    """Workspace files under `start` (default the root), sorted, ignore rules applied.
    Symlinks are followed only when they stay inside the workspace; loops are skipped."""
    root = Path(os.path.realpath(workspace))
    start = Path(os.path.realpath(start or root))
    ignore = Ignore(root)
    # load the .gitignore files of the directories above `start`
    parts = start.relative_to(root).parts if start != root else ()
    for i in range(len(parts) + 1):
        ignore.load_dir("/".join(parts[:i]))
    if start.is_file():
        yield start
        return
    seen_dirs: set[tuple[int, int]] = set()
    stack = [start]
    while stack:
        d = stack.pop()
        try:
            st = d.stat()
            if (st.st_dev, st.st_ino) in seen_dirs:
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        rel_dir = "" if d == root else d.relative_to(root).as_posix()
        ignore.load_dir(rel_dir)
        subdirs = []
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            p = Path(e.path)
            try:
                if e.is_symlink():
                    real = Path(os.path.realpath(p))
                    if not _inside(root, real):
                        continue
                is_dir = e.is_dir()
            except OSError:
                continue
            if ignore.ignored(rel, is_dir):
                continue
            if is_dir:
                subdirs.append(p)
            elif e.is_file():
                yield p
        stack.extend(reversed(subdirs))


def ignored(workspace: Path, path: Path) -> bool:
    """Whether `walk` would skip `path` (it, or a directory above it, is ignored)."""
    root = Path(os.path.realpath(workspace))
    try:
        parts = Path(os.path.realpath(path)).relative_to(root).parts
    except ValueError:
        return True
    rules = Ignore(root)
    for i in range(len(parts)):
        rules.load_dir("/".join(parts[:i]))
        rel = "/".join(parts[: i + 1])
        if rules.ignored(rel, is_dir=i < len(parts) - 1):
            return True
    return False
