"""list_files and grep over a real directory tree."""

from __future__ import annotations

import pytest

from agent_runtime.tools import ToolContext, ToolError
from agent_runtime.tools import search
from agent_runtime.tools.search import Grep, ListFiles


@pytest.fixture
def ctx(tmp_path):
    ws = tmp_path / "ws"
    for rel, text in {
        "README.md": "# demo\nTODO: docs\n",
        "src/app.py": "def main():\n    # TODO: parse args\n    return 0\n",
        "src/util.py": "def helper(x):\n    return x * 2\n",
        "tests/test_app.py": "from src.app import main\n",
        ".git/config": "TODO in git\n",
        "node_modules/lib/index.js": "// TODO\n",
        "data.bin": None,
    }.items():
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            p.write_bytes(b"TODO\x00\x01")
        else:
            p.write_text(text)
    return ToolContext(workspace=ws)


def test_list_files_skips_vcs_and_dependencies(ctx):
    res = ListFiles()({}, ctx)
    assert res.text.splitlines() == ["README.md", "data.bin", "src/app.py", "src/util.py",
                                     "tests/test_app.py"]


def test_list_files_with_path_and_glob(ctx):
    assert ListFiles()({"path": "src", "glob": "*.py"}, ctx).text == "src/app.py\nsrc/util.py"
    assert ListFiles()({"glob": "tests/**/*.py"}, ctx).text == "tests/test_app.py"


def test_list_files_caps_output(ctx, monkeypatch):
    monkeypatch.setattr(search, "MAX_FILES_LISTED", 2)
    res = ListFiles()({}, ctx)
    assert res.text.splitlines()[:2] == ["README.md", "data.bin"]
    assert "3 more files not shown (5 in all)" in res.text


def test_list_files_outside_is_refused(ctx):
    with pytest.raises(ToolError, match="outside the workspace"):
        ListFiles()({"path": ".."}, ctx)


def test_grep_shows_path_line_text_and_skips_binary_and_vcs(ctx):
    res = Grep()({"pattern": "TODO"}, ctx)
    assert res.text.splitlines() == ["README.md:2:TODO: docs", "src/app.py:2:    # TODO: parse args"]


def test_grep_with_glob_and_path(ctx):
    assert Grep()({"pattern": r"def \w+", "glob": "*.py", "path": "src"}, ctx).text == \
        "src/app.py:1:def main():\nsrc/util.py:1:def helper(x):"


def test_grep_caps_matches(ctx, monkeypatch):
    monkeypatch.setattr(search, "MAX_MATCHES", 1)
    res = Grep()({"pattern": "TODO"}, ctx)
    assert res.text.splitlines()[0] == "README.md:2:TODO: docs"
    assert "1 more matches not shown (2 in 2 files)" in res.text


def test_grep_invalid_regex_explains(ctx):
    with pytest.raises(ToolError, match="invalid regular expression"):
        Grep()({"pattern": "foo("}, ctx)


def test_grep_no_match(ctx):
    assert Grep()({"pattern": "nothing-like-this"}, ctx).text.startswith("[no matches")
