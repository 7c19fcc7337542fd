"""`list_files` and `grep`: find files by name and lines by regular expression.

Both walk the workspace with `paths.walk` (so `.git`, virtualenvs, `node_modules` and
.gitignored files are skipped) and cap their output, ending with a line that says what was
left out and how to narrow the request. `grep` uses Python's `re`, not ripgrep, so it works
wherever Python does; it is not built for multi-gigabyte trees.
"""

from __future__ import annotations

import re
from typing import Any

from agent_runtime.tools import paths
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult

MAX_FILES_LISTED = 400
MAX_MATCHES = 200
MAX_MATCH_CHARS = 300
MAX_GREP_FILE_BYTES = 4 * 2**20


def _start(ctx: ToolContext, args: dict[str, Any], tool: str):
    start = paths.resolve(ctx.workspace, args.get("path") or ".", tool=tool)
    if not start.exists():
        raise ToolError(f"{tool}: `{args.get('path')}` does not exist")
    return start


def _rel(ctx: ToolContext, p) -> str:
    return paths.display(ctx.workspace, p)


class ListFiles:
    name = "list_files"
    description = ("List the workspace's files (recursively, one path per line), skipping .git, "
                   "virtualenvs, node_modules and .gitignored files. Optionally under `path` and "
                   "matching `glob` (e.g. `*.py`, `src/**/test_*.py`).")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "Directory to list (default: workspace root)."},
            "glob": {"type": "string", "description": "Only paths matching this glob."},
        },
    }
    references = {"path": "dir"}               # what the strings name (agent_runtime.callgrammar)
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        start = _start(ctx, args, self.name)
        pattern = args.get("glob") or None
        found = sorted(rel for rel in (_rel(ctx, p) for p in paths.walk(ctx.workspace, start))
                       if pattern is None or paths.glob_match(rel, pattern))
        where = _rel(ctx, start)
        if not found:
            what = f" matching `{pattern}`" if pattern else ""
            return ToolResult(f"[no files{what} under {where}]", {"files": [], "total": 0})
        shown = found[:MAX_FILES_LISTED]
        text = "\n".join(shown)
        if len(found) > len(shown):
            text += (f"\n[{len(found) - len(shown):,} more files not shown ({len(found):,} in all); "
                     "narrow with path or glob]")
        return ToolResult(text, {"files": shown, "total": len(found)})


class Grep:
    name = "grep"
    description = ("Search file contents with a Python regular expression; prints "
                   "`path:line:text` for each matching line. Optionally under `path` (a "
                   "directory or file) and only in files matching `glob`. Use (?i) for "
                   "case-insensitive search.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "Regular expression (Python `re` syntax)."},
            "path": {"type": "string", "description": "Directory or file to search (default: workspace root)."},
            "glob": {"type": "string", "description": "Only search files whose path matches this glob."},
        },
        "required": ["pattern"],
    }
    references = {"path": "path"}
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        try:
            regex = re.compile(args["pattern"])
        except re.error as e:
            raise ToolError(f"grep: invalid regular expression {args['pattern']!r}: {e}. "
                            "Escape special characters like ( [ . * with a backslash.") from None
        start = _start(ctx, args, self.name)
        pattern = args.get("glob") or None
        out: list[str] = []
        n_matches = n_files = 0
        skipped = 0
        for p in paths.walk(ctx.workspace, start):
            rel = _rel(ctx, p)
            if pattern is not None and not paths.glob_match(rel, pattern):
                continue
            try:
                if p.stat().st_size > MAX_GREP_FILE_BYTES:
                    skipped += 1
                    continue
                data = p.read_bytes()
            except OSError:
                continue
            if paths.is_binary(data):
                continue
            hit = False
            for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if regex.search(line):
                    n_matches += 1
                    hit = True
                    if len(out) < MAX_MATCHES:
                        if len(line) > MAX_MATCH_CHARS:
                            line = line[:MAX_MATCH_CHARS] + "…"
                        out.append(f"{rel}:{lineno}:{line}")
            n_files += hit
        notes = []
        if n_matches > len(out):
            notes.append(f"{n_matches - len(out):,} more matches not shown ({n_matches:,} in "
                         f"{n_files:,} files); narrow the pattern, path or glob")
        if skipped:
            notes.append(f"{skipped} file(s) over {MAX_GREP_FILE_BYTES // 2**20} MB not searched")
        if not out:
            text = f"[no matches for {args['pattern']!r} under {_rel(ctx, start)}]"
        else:
            text = "\n".join(out)
        if notes:
            text += "\n[" + "; ".join(notes) + "]"
        return ToolResult(text, {"matches": n_matches, "files": n_files})
