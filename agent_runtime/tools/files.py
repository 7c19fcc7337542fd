"""`read_file`, `write_file`, `edit_file`: the tools that look at and change single files.

Messages are written for the model: a failed edit says how many places matched and where, a
binary or huge file gets a notice instead of its bytes. `edit_file` puts a unified diff in
`ToolResult.data["diff"]` for UIs. These tools do not run formatters, create backups or
track undo history; the session store and the UI own that.

Text goes through a `FileAccess`: the disk, unless a front end puts its own in
`ToolContext.extras["files"]` (an editor's buffers over ACP, so the agent reads and writes
what the user sees, unsaved changes included). Paths are resolved and confined to the
workspace before any access is asked.
"""

from __future__ import annotations

import difflib
import io
import re
from pathlib import Path
from typing import Any, Protocol

from agent_runtime.tools import paths
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult

DEFAULT_LIMIT = 400          # lines shown when no limit is given
MAX_LINE_CHARS = 1000        # longer lines are cut
MAX_OUTPUT_CHARS = 40_000    # read_file stops adding lines past this
HUGE_BYTES = 8 * 2**20       # past this, total lines are not counted
MAX_EDIT_BYTES = 16 * 2**20  # edit_file refuses larger files
MAX_DIFF_LINES = 2000


class FileAccess(Protocol):
    """Where the file tools read and write text. Failures raise OSError (or ToolError)."""

    def read_text(self, path: Path) -> str: ...

    def write_text(self, path: Path, content: str) -> None: ...


class DiskFiles:
    """The default `FileAccess`: UTF-8 files on disk, newlines kept as they are."""

    def read_text(self, path: Path) -> str:
        with open(path, "r", encoding="utf-8", errors="replace", newline="") as f:
            return f.read()

    def write_text(self, path: Path, content: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(content)


def file_access(ctx: ToolContext) -> FileAccess | None:
    """The front end's `FileAccess`, or None for plain disk access."""
    return ctx.extras.get("files")


def _notify_changed(ctx: ToolContext, path: Path) -> None:
    """Tell a live semantic index about a write, so the next search sees it at once."""
    from agent_runtime.tools.semantic import notify_changed
    notify_changed(ctx.workspace, path)


def _regular_file(path: Path, shown: str, tool: str) -> int:
    """The size of `path`, or a ToolError saying why it is not a file a tool can open."""
    if not path.exists():
        raise ToolError(f"{tool}: `{shown}` does not exist; list_files shows what is there")
    if path.is_dir():
        raise ToolError(f"{tool}: `{shown}` is a directory; use list_files to see its contents")
    if not path.is_file():
        raise ToolError(f"{tool}: `{shown}` is not a regular file (a pipe or device)")
    return path.stat().st_size


def _read_text(path: Path, shown: str, tool: str, files: FileAccess | None = None) -> str:
    size = _regular_file(path, shown, tool)
    if size > MAX_EDIT_BYTES:
        raise ToolError(f"{tool}: `{shown}` is too large to edit ({size:,} bytes)")
    if files is not None and not paths.is_binary(paths.sniff(path)):
        try:
            return files.read_text(path)
        except OSError as e:
            raise ToolError(f"{tool}: cannot read `{shown}`: {e.strerror or e}") from None
    data = path.read_bytes()
    if paths.is_binary(data):
        raise ToolError(f"{tool}: `{shown}` is a binary file ({size:,} bytes)")
    return data.decode("utf-8", "replace")


def _write_text(path: Path, content: str, shown: str, tool: str,
                files: FileAccess | None) -> None:
    try:
        (files or DiskFiles()).write_text(path, content)
    except OSError as e:
        raise ToolError(f"{tool}: cannot write `{shown}`: {e.strerror or e}") from None


def unified_diff(old: str, new: str, shown: str) -> str:
    lines = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                      f"a/{shown}", f"b/{shown}"))
    if len(lines) > MAX_DIFF_LINES:
        lines = lines[:MAX_DIFF_LINES] + [f"... ({len(lines) - MAX_DIFF_LINES} more diff lines)\n"]
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)


class ReadFile:
    name = "read_file"
    description = ("Read a text file of the workspace. Lines come numbered (`  12\\tcode`); the "
                   "numbers are not part of the file. Use offset (first line, 1-based) and limit "
                   f"(number of lines, default {DEFAULT_LIMIT}) to read a part of a long file.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "offset": {"type": "integer", "minimum": 1, "description": "First line to show (1-based)."},
            "limit": {"type": "integer", "minimum": 1, "description": "How many lines to show."},
        },
        "required": ["path"],
    }
    references = {"path": "file"}              # what the strings name (agent_runtime.callgrammar)
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        path = paths.resolve(ctx.workspace, args["path"], tool=self.name)
        shown = paths.display(ctx.workspace, path)
        size = _regular_file(path, shown, self.name)
        if paths.is_binary(paths.sniff(path)):
            return ToolResult(f"[`{shown}` is a binary file ({size:,} bytes); not shown]",
                              {"path": shown, "binary": True, "size": size})
        offset = max(1, int(args.get("offset") or 1))
        limit = max(1, int(args.get("limit") or DEFAULT_LIMIT))
        files = file_access(ctx)
        if files is None:
            with open(path, "r", encoding="utf-8", errors="replace", newline=None) as f:
                out, last, total, cut_lines = self._lines(f, offset, limit, size <= HUGE_BYTES)
        else:
            try:
                text = files.read_text(path)
            except OSError as e:
                raise ToolError(f"read_file: cannot read `{shown}`: {e.strerror or e}") from None
            out, last, total, cut_lines = self._lines(io.StringIO(text, newline=None), offset,
                                                      limit, True)
        if not out and size == 0:
            return ToolResult(f"[`{shown}` is empty]", {"path": shown, "lines": 0})
        if not out:
            where = f"it has {total:,} lines" if total is not None else "it is shorter than that"
            raise ToolError(f"read_file: offset {offset} is past the end of `{shown}`; {where}")
        text = "".join(out)
        notes = []
        if total is not None and last < total:
            notes.append(f"showing lines {offset}-{last} of {total:,}; "
                         f"continue with offset={last + 1}")
        elif total is None:
            notes.append(f"file is {size / 2**20:.0f} MB; showing lines {offset}-{last}; "
                         f"continue with offset={last + 1}, or search it with grep")
        if cut_lines:
            notes.append(f"{cut_lines} long line(s) cut at {MAX_LINE_CHARS} characters")
        if notes:
            text += "[" + "; ".join(notes) + "]\n"
        return ToolResult(text, {"path": shown, "first_line": offset, "last_line": last,
                                 "total_lines": total})

    @staticmethod
    def _lines(f: Any, offset: int, limit: int, count: bool):
        out: list[str] = []
        chars = cut = 0
        last = offset - 1
        n = 0
        for n, line in enumerate(f, 1):
            if n < offset:
                continue
            if len(out) >= limit or chars >= MAX_OUTPUT_CHARS:
                if not count:
                    return out, last, None, cut
                continue
            line = line.rstrip("\n")
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + f"… [+{len(line) - MAX_LINE_CHARS} chars]"
                cut += 1
            entry = f"{n:>6}\t{line}\n"
            out.append(entry)
            chars += len(entry)
            last = n
        return out, last, n, cut


class WriteFile:
    name = "write_file"
    description = ("Create a file, or replace a file's whole content. Parent directories are "
                   "created. To change part of an existing file, prefer edit_file.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "content": {"type": "string", "description": "The complete new content of the file."},
        },
        "required": ["path", "content"],
    }
    mutates = True

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        path = paths.resolve(ctx.workspace, args["path"], tool=self.name)
        shown = paths.display(ctx.workspace, path)
        content = args["content"]
        if path.is_dir():
            raise ToolError(f"write_file: `{shown}` is a directory")
        if path.exists() and not path.is_file():
            raise ToolError(f"write_file: `{shown}` is not a regular file")
        files = file_access(ctx)
        old = None
        if path.exists() and path.stat().st_size <= MAX_EDIT_BYTES \
                and not paths.is_binary(paths.sniff(path)):
            old = _read_text(path, shown, self.name, files)
        created = not path.exists()
        _write_text(path, content, shown, self.name, files)
        _notify_changed(ctx, path)
        n_lines = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        verb = "Created" if created else "Overwrote"
        data: dict[str, Any] = {"path": shown, "created": created, "bytes": len(content.encode())}
        if old is not None:
            data["diff"] = unified_diff(old, content, shown)
        elif created:
            data["diff"] = unified_diff("", content, shown)
        return ToolResult(f"{verb} {shown} ({n_lines} line{'s' * (n_lines != 1)}).", data)


class EditFile:
    name = "edit_file"
    description = ("Replace an exact piece of text in a file. `old` must match the file exactly "
                   "(whitespace and indentation included, without read_file's line numbers) "
                   "and match only one place, unless replace_all is true.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "old": {"type": "string", "description": "The exact text to replace."},
            "new": {"type": "string", "description": "The text to put in its place."},
            "replace_all": {"type": "boolean", "description": "Replace every occurrence of `old`."},
        },
        "required": ["path", "old", "new"],
    }
    references = {"path": "file", "old": "text:path", "new": "differs:old"}
    mutates = True

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        path = paths.resolve(ctx.workspace, args["path"], tool=self.name)
        shown = paths.display(ctx.workspace, path)
        old, new = args["old"], args["new"]
        if not old:
            raise ToolError("edit_file: `old` is empty; to create or overwrite a file use write_file")
        if old == new:
            raise ToolError("edit_file: `old` and `new` are the same; nothing to change")
        if not path.exists():
            raise ToolError(f"edit_file: `{shown}` does not exist; use write_file to create it")
        files = file_access(ctx)
        original = _read_text(path, shown, self.name, files)
        crlf = "\r\n" in original and "\r\n" not in old
        text = original.replace("\r\n", "\n") if crlf else original
        starts = _find_all(text, old)
        if not starts:
            raise ToolError(_no_match_message(text, old, shown))
        if len(starts) > 1 and not args.get("replace_all"):
            raise ToolError(_many_matches_message(text, old, starts, shown))
        updated = text.replace(old, new) if args.get("replace_all") else text.replace(old, new, 1)
        if crlf:
            updated = updated.replace("\n", "\r\n")
        _write_text(path, updated, shown, self.name, files)
        _notify_changed(ctx, path)
        lines = [text.count("\n", 0, s) + 1 for s in starts]
        where = f"line {lines[0]}" if len(lines) == 1 else "lines " + ", ".join(map(str, lines[:20]))
        count = len(starts)
        diff = unified_diff(original, updated, shown)
        return ToolResult(f"Edited {shown}: {count} replacement{'s' * (count > 1)} at {where}.",
                          {"path": shown, "replacements": count, "lines": lines, "diff": diff})


def _find_all(text: str, needle: str) -> list[int]:
    starts, i = [], text.find(needle)
    while i != -1:
        starts.append(i)
        i = text.find(needle, i + len(needle))
    return starts


def _snippet(lines: list[str], first: int, count: int) -> str:
    """Lines [first, first+count) of the file (0-based first), numbered like read_file."""
    chunk = lines[first:first + count]
    return "".join(f"{first + i + 1:>6}\t{line[:200]}\n" for i, line in enumerate(chunk))


def _many_matches_message(text: str, old: str, starts: list[int], shown: str) -> str:
    lines = text.splitlines()
    at = [text.count("\n", 0, s) + 1 for s in starts]
    listed = ", ".join(map(str, at[:10])) + (", ..." if len(at) > 10 else "")
    msg = (f"edit_file: `old` matched {len(at)} places in {shown} (lines {listed}); "
           "give more surrounding lines so it matches one place, or set replace_all=true.\n")
    span = max(1, old.count("\n") + 1)
    for line in at[:5]:
        msg += f"--- match at line {line}:\n" + _snippet(lines, line - 1, min(span, 5))
    return msg.rstrip("\n")


def _no_match_message(text: str, old: str, shown: str) -> str:
    msg = f"edit_file: `old` was not found in {shown}."
    if re.match(r"\s*\d+\t", old):
        msg += " It seems to include read_file's line numbers; leave them out."
    lines = text.splitlines()
    old_lines = old.strip("\n").splitlines() or [old]
    # whitespace-insensitive match first: the usual mistake is indentation
    squash = lambda s: re.sub(r"\s+", " ", s).strip()
    target = [squash(s) for s in old_lines]
    span = len(old_lines)
    candidates: list[tuple[float, int]] = []
    if len(lines) <= 20_000:
        for i in range(0, max(1, len(lines) - span + 1)):
            if [squash(s) for s in lines[i:i + span]] == target:
                candidates.append((1.0, i))
        if not candidates:
            first = max(old_lines, key=lambda s: len(s.strip()))
            near = difflib.get_close_matches(first, lines, n=3, cutoff=0.6)
            offset = old_lines.index(first)
            for cand in near:
                for i, line in enumerate(lines):
                    if line == cand:
                        candidates.append((0.5, max(0, i - offset)))
                        break
    if candidates:
        exact_ws = candidates[0][0] == 1.0
        msg += (" It matches if whitespace is ignored; the file has:" if exact_ws else
                " The closest text in the file:")
        for _, i in candidates[:3]:
            msg += "\n" + _snippet(lines, i, min(span, 8)).rstrip("\n")
        msg += "\nCopy the text exactly as the file has it (read_file shows it)."
    else:
        msg += " Read the file again (read_file) and copy the text exactly."
    return msg
