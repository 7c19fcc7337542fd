"""File tools through a front end's `FileAccess` (ctx.extras["files"]): an editor's buffers."""

from __future__ import annotations

from pathlib import Path

from agent_runtime.tools.base import ToolContext
from agent_runtime.tools.files import EditFile, ReadFile, WriteFile


class Buffers:
    """An editor with unsaved buffers: reads see the buffer, writes go to the buffer."""

    def __init__(self, buffers: dict[Path, str]):
        self.buffers = buffers

    def read_text(self, path: Path) -> str:
        return self.buffers[path] if path in self.buffers else path.read_text()

    def write_text(self, path: Path, content: str) -> None:
        self.buffers[path] = content


def _setup(tmp_path):
    (tmp_path / "a.py").write_text("on disk\n")
    buffers = Buffers({(tmp_path / "a.py").resolve(): "unsaved buffer\n"})
    return buffers, ToolContext(workspace=tmp_path.resolve(), extras={"files": buffers})


def test_read_file_reads_the_buffer_not_the_disk(tmp_path):
    _, ctx = _setup(tmp_path)
    assert "unsaved buffer" in ReadFile()({"path": "a.py"}, ctx).text


def test_edit_file_edits_the_buffer_and_leaves_the_disk(tmp_path):
    buffers, ctx = _setup(tmp_path)
    EditFile()({"path": "a.py", "old": "unsaved", "new": "edited"}, ctx)
    assert buffers.buffers[(tmp_path / "a.py").resolve()] == "edited buffer\n"
    assert (tmp_path / "a.py").read_text() == "on disk\n"


def test_write_file_diff_is_against_the_buffer(tmp_path):
    _, ctx = _setup(tmp_path)
    diff = WriteFile()({"path": "a.py", "content": "new\n"}, ctx).data["diff"]
    assert "-unsaved buffer" in diff
