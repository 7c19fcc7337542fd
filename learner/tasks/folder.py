"""Task folders: bring-your-own tasks, and the format generated instances export to.

A task folder holds `task.json` (`{"instruction": ..., "test": "shell command, exit 0 =
solved", "timeout": seconds}`, plus optional `env`, `expect_output`, `id`, `family`, `split`,
`difficulty`, `meta`), `repo/` (the starting workspace) and `tests/` (hidden: at grading,
`tests/X` is copied to `tests/X` of a copy of the finished workspace, then `test` runs at that
copy's root). An exported instance may also carry `solution.json`, the oracle's plan.
This module only converts between folders and `TaskInstance`s; it runs nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from learner.tasks import TaskInstance

TASK_FILE = "task.json"
SOLUTION_FILE = "solution.json"


class TaskFolderError(ValueError):
    """A task folder is missing a part or has a malformed task.json."""


def _read_tree(root: Path) -> dict[str, str | bytes]:
    files: dict[str, str | bytes] = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/"):
            continue
        data = path.read_bytes()
        try:
            files[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            files[rel] = data
    return files


def load_task_folder(path) -> "TaskInstance":
    """The task in folder `path` (see the module docstring for the layout)."""
    from learner.tasks import TaskInstance
    root = Path(path)
    spec_path = root / TASK_FILE
    if not spec_path.is_file():
        raise TaskFolderError(f"{root}: no {TASK_FILE}")
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskFolderError(f"{spec_path}: not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise TaskFolderError(f"{spec_path}: must hold a JSON object")
    for key in ("instruction", "test"):
        if not isinstance(spec.get(key), str) or not spec[key].strip():
            raise TaskFolderError(f"{spec_path}: `{key}` must be a non-empty string")
    timeout = spec.get("timeout", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise TaskFolderError(f"{spec_path}: `timeout` must be a positive number of seconds")
    if not (root / "repo").is_dir():
        raise TaskFolderError(f"{root}: no repo/ folder (the starting workspace)")
    hidden = {f"tests/{rel}": content for rel, content in _read_tree(root / "tests").items()} \
        if (root / "tests").is_dir() else {}
    solution = None
    if (root / SOLUTION_FILE).is_file():
        solution = json.loads((root / SOLUTION_FILE).read_text(encoding="utf-8"))
    return TaskInstance(
        id=str(spec.get("id") or root.resolve().name), family=str(spec.get("family", "folder")),
        split=str(spec.get("split", "folder")), difficulty=int(spec.get("difficulty", 0)),
        instruction=spec["instruction"], files=_read_tree(root / "repo"), hidden_tests=hidden,
        test_command=spec["test"], timeout=float(timeout), solution=solution,
        env={str(k): str(v) for k, v in (spec.get("env") or {}).items()},
        expect_output=spec.get("expect_output"), meta=dict(spec.get("meta") or {}),
        source=str(root.resolve()))


def load_tasks(path) -> list["TaskInstance"]:
    """One task folder, or every task folder directly inside `path` (sorted by name)."""
    root = Path(path)
    if (root / TASK_FILE).is_file():
        return [load_task_folder(root)]
    if not root.is_dir():
        raise TaskFolderError(f"{root}: not a folder")
    folders = sorted(p for p in root.iterdir() if (p / TASK_FILE).is_file())
    if not folders:
        raise TaskFolderError(f"{root}: neither a task folder nor a folder of task folders "
                              f"(no {TASK_FILE} found)")
    return [load_task_folder(p) for p in folders]


def folder_name(task_id: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in task_id)


def _write_tree(root: Path, files: dict[str, str | bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def export(instances: Iterable["TaskInstance"], out_dir, with_solution: bool = False) -> list[Path]:
    """Write each instance as a task folder under `out_dir`; returns the folders.

    An existing task folder of the same name is replaced; any other existing folder in the
    way is an error."""
    out = Path(out_dir)
    written = []
    for task in instances:
        folder = out / folder_name(task.id)
        if folder.exists():
            if not (folder / TASK_FILE).is_file():
                raise TaskFolderError(f"{folder} exists and is not a task folder")
            shutil.rmtree(folder)
        hidden = {}
        for rel, content in task.hidden_tests.items():
            if not rel.startswith("tests/"):
                raise TaskFolderError(f"{task.id}: hidden file {rel} is not under tests/")
            hidden[rel[len("tests/"):]] = content
        spec = {"instruction": task.instruction, "test": task.test_command,
                "timeout": task.timeout, "id": task.id, "family": task.family,
                "split": task.split, "difficulty": task.difficulty}
        if task.env:
            spec["env"] = task.env
        if task.expect_output:
            spec["expect_output"] = task.expect_output
        if task.meta:
            spec["meta"] = task.meta
        _write_tree(folder / "repo", task.files)
        _write_tree(folder / "tests", hidden)
        (folder / TASK_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
        if with_solution and task.solution is not None:
            (folder / SOLUTION_FILE).write_text(json.dumps(task.solution, indent=2) + "\n",
                                                encoding="utf-8")
        written.append(folder)
    return written
