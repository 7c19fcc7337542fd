"""Task folders: export and load round trip, user-made folders, malformed folders."""

from __future__ import annotations

import json

import pytest

from learner.tasks import export, generate, grade, load_task_folder, load_tasks
from learner.tasks.folder import TaskFolderError


def make_folder(root, instruction="Make check.py exit 0.", test="python check.py", **extra):
    (root / "repo").mkdir(parents=True)
    (root / "repo" / "value.txt").write_text("1\n")
    (root / "tests").mkdir()
    (root / "tests" / "check_value.py").write_text("print(open('value.txt').read())\n")
    (root / "task.json").write_text(json.dumps({"instruction": instruction, "test": test,
                                                "timeout": 30, **extra}))
    return root


def test_export_then_load_gives_back_the_same_task(tmp_path):
    tasks = generate("heldout", 6, seed=4)
    folders = export(tasks, tmp_path, with_solution=True)
    assert [f.name for f in folders] == [t.id.replace("/", "-") for t in tasks]
    for task, folder in zip(tasks, folders):
        assert sorted(p.name for p in folder.iterdir()) == ["repo", "solution.json",
                                                             "task.json", "tests"]
        loaded = load_task_folder(folder)
        assert (loaded.id, loaded.family, loaded.split, loaded.difficulty) == \
            (task.id, task.family, task.split, task.difficulty)
        assert loaded.instruction == task.instruction
        assert loaded.files == task.files and loaded.hidden_tests == task.hidden_tests
        assert loaded.test_command == task.test_command and loaded.timeout == task.timeout
        assert loaded.env == task.env and loaded.expect_output == task.expect_output
        assert loaded.solution == task.solution and loaded.source == str(folder.resolve())


def test_export_without_solution_keeps_the_plan_private(tmp_path):
    (folder,) = export(generate("train", 1), tmp_path)
    assert not (folder / "solution.json").exists()
    assert load_task_folder(folder).solution is None


def test_export_replaces_an_older_export_but_nothing_else(tmp_path):
    task = generate("train", 1)[0]
    (folder,) = export([task], tmp_path)
    (folder / "repo" / "stale.txt").write_text("old")
    export([task], tmp_path)
    assert not (folder / "repo" / "stale.txt").exists()
    other = tmp_path / "not-a-task"
    other.mkdir()
    from dataclasses import replace
    with pytest.raises(TaskFolderError, match="not a task folder"):
        export([replace(task, id="not-a-task")], tmp_path)


def test_a_user_folder_loads_with_defaults_and_grades_with_its_command(tmp_path):
    folder = make_folder(tmp_path / "mytask", test="python tests/check_value.py | grep -q 2")
    task = load_task_folder(folder)
    assert (task.id, task.family, task.split, task.timeout) == ("mytask", "folder", "folder", 30)
    assert task.files == {"value.txt": "1\n"}
    assert task.hidden_tests == {"tests/check_value.py": "print(open('value.txt').read())\n"}
    workspace = tmp_path / "ws"
    task.materialize(workspace)
    assert not grade(task, workspace).passed
    (workspace / "value.txt").write_text("2\n")
    result = grade(task, workspace)
    assert result.passed and result.reward == 1.0
    assert not (workspace / "tests").exists()             # graded on a copy


def test_load_tasks_takes_one_folder_or_a_folder_of_folders(tmp_path):
    make_folder(tmp_path / "b")
    make_folder(tmp_path / "a")
    (tmp_path / "notes").mkdir()
    assert [t.id for t in load_tasks(tmp_path)] == ["a", "b"]
    assert [t.id for t in load_tasks(tmp_path / "b")] == ["b"]
    with pytest.raises(TaskFolderError, match="no task.json"):
        load_tasks(tmp_path / "notes")


@pytest.mark.parametrize("spec, message", [
    ({"test": "true"}, "instruction"),
    ({"instruction": "x"}, "test"),
    ({"instruction": "x", "test": "true", "timeout": 0}, "timeout"),
    ({"instruction": "x", "test": "true", "timeout": "soon"}, "timeout"),
])
def test_malformed_task_json_is_reported(tmp_path, spec, message):
    (tmp_path / "repo").mkdir()
    (tmp_path / "task.json").write_text(json.dumps(spec))
    with pytest.raises(TaskFolderError, match=message):
        load_task_folder(tmp_path)


def test_a_folder_without_repo_or_with_bad_json_is_reported(tmp_path):
    (tmp_path / "task.json").write_text('{"instruction": "x", "test": "true"}')
    with pytest.raises(TaskFolderError, match="repo/"):
        load_task_folder(tmp_path)
    (tmp_path / "repo").mkdir()
    (tmp_path / "task.json").write_text("{not json")
    with pytest.raises(TaskFolderError, match="not valid JSON"):
        load_task_folder(tmp_path)


def test_binary_files_survive_the_round_trip(tmp_path):
    folder = make_folder(tmp_path / "bin")
    (folder / "repo" / "blob.bin").write_bytes(b"\x00\xff\x10")
    task = load_task_folder(folder)
    assert task.files["blob.bin"] == b"\x00\xff\x10"
    task.materialize(tmp_path / "ws")
    assert (tmp_path / "ws" / "blob.bin").read_bytes() == b"\x00\xff\x10"
