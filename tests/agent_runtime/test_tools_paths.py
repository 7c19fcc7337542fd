"""Workspace confinement, ignore rules and globbing of agent_runtime.tools.paths."""

from __future__ import annotations

import os

import pytest

from agent_runtime.tools import ToolError
from agent_runtime.tools import paths


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    return root


def test_relative_path_resolves_inside(ws):
    assert paths.resolve(ws, "src/pkg/mod.py") == (ws / "src/pkg/mod.py").resolve()


def test_dotdot_that_stays_inside_is_allowed(ws):
    assert paths.resolve(ws, "src/pkg/../pkg/mod.py") == (ws / "src/pkg/mod.py").resolve()


def test_dotdot_leaving_workspace_is_refused(ws):
    with pytest.raises(ToolError, match="outside the workspace"):
        paths.resolve(ws, "../secret.txt")


def test_absolute_path_outside_is_refused(ws):
    with pytest.raises(ToolError, match="outside the workspace"):
        paths.resolve(ws, "/etc/passwd")


def test_absolute_path_inside_is_allowed(ws):
    target = ws / "src" / "pkg" / "mod.py"
    assert paths.resolve(ws, str(target)) == target.resolve()


def test_a_path_under_the_sandbox_mount_is_that_path_of_the_workspace(ws):
    assert paths.resolve(ws, "/workspace/src/pkg/mod.py") == (ws / "src/pkg/mod.py").resolve()
    assert paths.resolve(ws, "/workspace") == ws.resolve()
    with pytest.raises(ToolError, match="outside the workspace"):
        paths.resolve(ws, "/workspace/../etc/passwd")
    with pytest.raises(ToolError, match="outside the workspace"):
        paths.resolve(ws, "/workspaces/src")


def test_symlink_leaving_workspace_is_refused(ws, tmp_path):
    (tmp_path / "secret.txt").write_text("s")
    os.symlink(tmp_path / "secret.txt", ws / "link.txt")
    with pytest.raises(ToolError, match="symlink"):
        paths.resolve(ws, "link.txt")


def test_symlinked_directory_leaving_workspace_is_refused_for_new_files(ws, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", ws / "out")
    with pytest.raises(ToolError, match="outside the workspace"):
        paths.resolve(ws, "out/new.txt")


@pytest.mark.parametrize("rel,pattern,expected", [
    ("src/pkg/mod.py", "*.py", True),
    ("src/pkg/mod.py", "src/**/*.py", True),
    ("src/mod.py", "src/**/*.py", True),
    ("src/pkg/mod.py", "src/*.py", False),
    ("tests/test_a.py", "tests/test_*.py", True),
    ("README.md", "*.{md,rst}", True),
    ("a/b.txt", "*.py", False),
])
def test_glob_match(rel, pattern, expected):
    assert paths.glob_match(rel, pattern) is expected


def test_walk_skips_vcs_venv_and_gitignored(ws):
    for d in (".git", ".venv", "node_modules", "src/__pycache__", "build"):
        (ws / d).mkdir(parents=True, exist_ok=True)
        (ws / d / "f.py").write_text("")
    (ws / ".gitignore").write_text("build/\n*.log\n!keep.log\n")
    (ws / "a.log").write_text("")
    (ws / "keep.log").write_text("")
    (ws / "src" / ".gitignore").write_text("generated.py\n")
    (ws / "src" / "generated.py").write_text("")
    found = sorted(p.relative_to(ws).as_posix() for p in paths.walk(ws))
    assert found == [".gitignore", "keep.log", "src/.gitignore", "src/pkg/mod.py"]


def test_walk_does_not_follow_symlinks_out(ws, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.py").write_text("")
    os.symlink(tmp_path / "outside", ws / "escape")
    assert all("escape" not in p.as_posix() for p in paths.walk(ws))


def test_ignored_checks_parent_directories(ws):
    (ws / ".gitignore").write_text("src/pkg/\n")
    assert paths.ignored(ws, ws / "src" / "pkg" / "mod.py")
    assert not paths.ignored(ws, ws / "src" / "other.py")
