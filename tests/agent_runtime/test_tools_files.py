"""read_file, write_file and edit_file on real files."""

from __future__ import annotations

import pytest

from agent_runtime.tools import ToolContext, ToolError
from agent_runtime.tools.files import DEFAULT_LIMIT, EditFile, ReadFile, WriteFile


@pytest.fixture
def ctx(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return ToolContext(workspace=ws)


def _write(ctx, rel, text):
    p = ctx.workspace / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


# ---- read_file

def test_read_numbers_lines(ctx):
    _write(ctx, "a.py", "one\ntwo\n")
    assert ReadFile()({"path": "a.py"}, ctx).text == "     1\tone\n     2\ttwo\n"


def test_read_offset_and_limit(ctx):
    _write(ctx, "a.txt", "".join(f"line {i}\n" for i in range(1, 101)))
    res = ReadFile()({"path": "a.txt", "offset": 10, "limit": 3}, ctx)
    assert res.text.splitlines()[:3] == ["    10\tline 10", "    11\tline 11", "    12\tline 12"]
    assert "showing lines 10-12 of 100; continue with offset=13" in res.text


def test_read_long_file_stops_at_default_limit(ctx):
    _write(ctx, "big.txt", "x\n" * (DEFAULT_LIMIT + 50))
    res = ReadFile()({"path": "big.txt"}, ctx)
    assert res.data["last_line"] == DEFAULT_LIMIT
    assert f"continue with offset={DEFAULT_LIMIT + 1}" in res.text


def test_read_binary_file_gives_notice(ctx):
    (ctx.workspace / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200))
    res = ReadFile()({"path": "img.png"}, ctx)
    assert "binary file" in res.text and "\x00" not in res.text


def test_read_huge_line_is_cut(ctx):
    _write(ctx, "min.js", "a" * 100_000 + "\n")
    res = ReadFile()({"path": "min.js"}, ctx)
    assert len(res.text) < 2_000 and "long line(s) cut" in res.text


def test_read_missing_file_is_an_error(ctx):
    with pytest.raises(ToolError, match="does not exist"):
        ReadFile()({"path": "nope.py"}, ctx)


def test_read_outside_workspace_is_refused(ctx):
    with pytest.raises(ToolError, match="outside the workspace"):
        ReadFile()({"path": "../../etc/passwd"}, ctx)


def test_read_offset_past_end_is_an_error(ctx):
    _write(ctx, "a.txt", "one\n")
    with pytest.raises(ToolError, match="past the end"):
        ReadFile()({"path": "a.txt", "offset": 5}, ctx)


# ---- write_file

def test_write_creates_file_and_parents(ctx):
    res = WriteFile()({"path": "new/dir/f.py", "content": "print(1)\n"}, ctx)
    assert (ctx.workspace / "new/dir/f.py").read_text() == "print(1)\n"
    assert res.text == "Created new/dir/f.py (1 line)." and res.data["created"]


def test_write_overwrite_reports_diff(ctx):
    _write(ctx, "f.py", "a = 1\n")
    res = WriteFile()({"path": "f.py", "content": "a = 2\n"}, ctx)
    assert res.text.startswith("Overwrote f.py")
    assert "-a = 1\n+a = 2\n" in res.data["diff"]


def test_write_outside_workspace_is_refused(ctx, tmp_path):
    with pytest.raises(ToolError, match="outside the workspace"):
        WriteFile()({"path": "../escape.txt", "content": "x"}, ctx)
    assert not (tmp_path / "escape.txt").exists()


# ---- edit_file

def test_edit_replaces_unique_match_and_returns_diff(ctx):
    p = _write(ctx, "calc.py", "def add(a, b):\n    return a - b\n")
    res = EditFile()({"path": "calc.py", "old": "a - b", "new": "a + b"}, ctx)
    assert p.read_text() == "def add(a, b):\n    return a + b\n"
    assert res.text == "Edited calc.py: 1 replacement at line 2."
    assert "-    return a - b\n+    return a + b\n" in res.data["diff"]


def test_edit_several_matches_lists_them(ctx):
    p = _write(ctx, "f.py", "x = 1\ny = 2\nx = 1\n\nx = 1\n")
    with pytest.raises(ToolError) as e:
        EditFile()({"path": "f.py", "old": "x = 1", "new": "x = 3"}, ctx)
    assert "matched 3 places in f.py (lines 1, 3, 5)" in str(e.value)
    assert "replace_all=true" in str(e.value)
    assert p.read_text() == "x = 1\ny = 2\nx = 1\n\nx = 1\n"


def test_edit_replace_all(ctx):
    p = _write(ctx, "f.py", "x = 1\nx = 1\n")
    res = EditFile()({"path": "f.py", "old": "x = 1", "new": "x = 3", "replace_all": True}, ctx)
    assert p.read_text() == "x = 3\nx = 3\n" and res.data["replacements"] == 2


def test_edit_no_match_shows_whitespace_candidate(ctx):
    _write(ctx, "f.py", "def f():\n    return 1\n")
    with pytest.raises(ToolError) as e:
        EditFile()({"path": "f.py", "old": "def f():\n  return 1", "new": "x"}, ctx)
    msg = str(e.value)
    assert "not found" in msg and "whitespace is ignored" in msg and "     2\t    return 1" in msg


def test_edit_no_match_shows_closest_text(ctx):
    _write(ctx, "f.py", "total = compute_total(items)\nprint(total)\n")
    with pytest.raises(ToolError) as e:
        EditFile()({"path": "f.py", "old": "total = compute_totals(items)", "new": "x"}, ctx)
    assert "closest text" in str(e.value) and "compute_total(items)" in str(e.value)


def test_edit_keeps_crlf_line_endings(ctx):
    p = ctx.workspace / "win.txt"
    p.write_bytes(b"a\r\nb\r\nc\r\n")
    EditFile()({"path": "win.txt", "old": "a\nb", "new": "A\nB"}, ctx)
    assert p.read_bytes() == b"A\r\nB\r\nc\r\n"


def test_edit_missing_file_points_to_write_file(ctx):
    with pytest.raises(ToolError, match="write_file"):
        EditFile()({"path": "nope.py", "old": "a", "new": "b"}, ctx)


def test_edit_binary_file_is_refused(ctx):
    (ctx.workspace / "b.bin").write_bytes(b"a\x00b")
    with pytest.raises(ToolError, match="binary"):
        EditFile()({"path": "b.bin", "old": "a", "new": "b"}, ctx)


def test_read_fifo_is_refused_without_blocking(ctx):
    import os
    os.mkfifo(ctx.workspace / "pipe")
    with pytest.raises(ToolError, match="not a regular file"):
        ReadFile()({"path": "pipe"}, ctx)
