"""Chunks and terms for the semantic index: how files are cut and how text becomes tokens.

Python files are cut along the syntax tree (a chunk per top-level function or class, one per
method in classes longer than `MAX_CLASS_LINES`, module-level code in windows); other text
files into overlapping windows of `WINDOW` lines. Tokens are lower-cased identifier parts
(`parseConfigFile` and `parse_config_file` both give parse, config, file plus the whole
identifier) with a light suffix stemmer, so that "parsing config files" meets `parse_config`.
Nothing here touches SQLite or the file system.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

WINDOW = 40            # lines per window chunk
STEP = 30              # window start every STEP lines (WINDOW - STEP lines overlap)
MAX_CLASS_LINES = 80   # longer classes are split into methods
MAX_CHUNK_LINES = 150  # longer functions are split into windows

INDEXED_SUFFIXES = frozenset("""
py pyi js jsx ts tsx mjs cjs go rs java kt kts scala c h cc cpp cxx hpp hh cs rb php swift m mm
sh bash zsh fish ps1 lua r jl ex exs erl hs ml mli clj dart vue svelte sql html css scss less
md rst txt toml yaml yml json ini cfg conf proto graphql tf nix cmake gradle
""".split())
INDEXED_NAMES = frozenset({"Makefile", "Dockerfile", "Justfile", "Rakefile", "Gemfile",
                           "CMakeLists.txt", "README", "LICENSE", "Procfile"})
LOCKFILES = frozenset({"package-lock.json", "yarn.lock", "poetry.lock", "Cargo.lock",
                       "uv.lock", "pnpm-lock.yaml", "composer.lock", "Pipfile.lock"})

STOPWORDS = frozenset("""
a an and are as at be been but by can do does doing for from has have how i if in into is it
its me my of on or our so than that the their them then there these they this those to was we
were what when where which while who why will with you your
""".split())

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_SUFFIXES = ("ings", "ing", "ers", "er", "ied", "ies", "es", "ed", "s", "e")


@dataclass
class Chunk:
    path: str          # workspace-relative, posix
    start: int         # first line, 1-based
    end: int           # last line, inclusive
    kind: str          # "function", "class", "method", "module", "window"
    name: str          # qualified name for Python definitions, else ""
    text: str


def indexable(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if name in LOCKFILES:
        return False
    if name in INDEXED_NAMES:
        return True
    return "." in name and name.rsplit(".", 1)[1].lower() in INDEXED_SUFFIXES


def stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: -len(suffix)]
            break
    return word[:-1] + "i" if word.endswith("y") and len(word) > 3 else word


def tokenize(text: str) -> list[str]:
    """Index terms of `text`: identifier parts, stemmed, minus stop words and 1-letter parts."""
    out: list[str] = []
    for ident in _IDENT.findall(text):
        parts = [p.lower() for piece in ident.split("_") for p in _CAMEL.findall(piece)]
        parts = [p for p in parts if len(p) > 1 and not p.isdigit() and p not in STOPWORDS]
        if len(parts) > 1:
            out.append(ident.lower().strip("_"))
        out.extend(stem(p) for p in parts)
    return out


def chunk_file(rel: str, text: str) -> list[Chunk]:
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        return []
    if rel.endswith((".py", ".pyi")):
        try:
            return _python_chunks(rel, lines, ast.parse(text))
        except (SyntaxError, ValueError, RecursionError):
            pass
    return _windows(rel, lines, 1, len(lines), "window", "")


def _windows(rel: str, lines: list[str], first: int, last: int, kind: str, name: str) -> list[Chunk]:
    """Windows over lines first..last (1-based, inclusive); blank-only windows skipped."""
    out = []
    start = first
    while start <= last:
        end = min(start + WINDOW - 1, last)
        body = lines[start - 1:end]
        if any(line.strip() for line in body):
            out.append(Chunk(rel, start, end, kind, name, "\n".join(body)))
        if end == last:
            break
        start += STEP
    return out


def _span(node: ast.AST) -> tuple[int, int]:
    decorators = getattr(node, "decorator_list", [])
    start = min([node.lineno] + [d.lineno for d in decorators])
    return start, node.end_lineno or node.lineno


def _python_chunks(rel: str, lines: list[str], tree: ast.Module) -> list[Chunk]:
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    spans: list[tuple[int, int, str, str]] = []
    for node in tree.body:
        if not isinstance(node, defs):
            continue
        start, end = _span(node)
        if isinstance(node, ast.ClassDef) and end - start + 1 > MAX_CLASS_LINES:
            methods = [n for n in node.body if isinstance(n, defs)]
            header_end = _span(methods[0])[0] - 1 if methods else end
            spans.append((start, header_end, "class", node.name))
            for m in methods:
                m_start, m_end = _span(m)
                spans.append((m_start, m_end, "method", f"{node.name}.{m.name}"))
        else:
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            spans.append((start, end, kind, node.name))
    out: list[Chunk] = []
    covered = [False] * (len(lines) + 2)
    for start, end, kind, name in spans:
        for i in range(start, end + 1):
            covered[i] = True
        if end - start + 1 > MAX_CHUNK_LINES:
            out.extend(_windows(rel, lines, start, end, kind, name))
        elif start <= end:
            out.append(Chunk(rel, start, end, kind, name, "\n".join(lines[start - 1:end])))
    # module-level code between definitions, in windows
    i = 1
    while i <= len(lines):
        if covered[i]:
            i += 1
            continue
        j = i
        while j + 1 <= len(lines) and not covered[j + 1]:
            j += 1
        out.extend(_windows(rel, lines, i, j, "module", ""))
        i = j + 1
    return sorted(out, key=lambda c: (c.start, c.end))
