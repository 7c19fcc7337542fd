"""Pre-training text chosen for what the tasks need: the simulated repositories, solved.

`solved_files(task)` applies the oracle's own `edit_file` / `write_file` calls to the task's
starting files in memory (no workspace, no subprocess), so the text is the repository as it looks
once the task is done: the kernels written correctly, renamed symbols, fixed imports, added
features with their tests, plus the hidden tests. `repo_texts(n, seed)` renders `n` training
instances as documents, one file after another under a `# file: PATH` line, which is how the
model later meets code (a path, then its content). Only the training split is used; held-out
kernels, domains and phrasings never reach this text.

It does not tokenize or train (the corpus and pretrain stages do).
"""

from __future__ import annotations

from typing import Iterator

from learner import tasks as sim
from learner.tasks.rename import apply_rename


def solved_files(task) -> dict[str, str]:
    """The task's text files after its oracle plan's edits (and a rename's `sed`), with the
    hidden tests added."""
    files = {p: c for p, c in task.files.items() if isinstance(c, str)}
    for turn in (task.solution or {}).get("turns", []):
        for call in turn["calls"]:
            args = call.get("arguments") or {}
            path = args.get("path")
            if call["name"] == "write_file" and path:
                files[path] = args.get("content", "")
            elif call["name"] == "edit_file" and path in files and args.get("old"):
                count = -1 if args.get("replace_all") else 1
                files[path] = files[path].replace(args["old"], args.get("new", ""), count)
            elif call["name"] == "run_command":              # a rename's substitution
                files = apply_rename(str(args.get("command", "")), files) or files
    files.update({p: c for p, c in task.hidden_tests.items() if isinstance(c, str)})
    return files


def repo_texts(n: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(task id, document) for `n` solved training instances, families in turn."""
    for task in sim.generate("train", n, seed=seed):
        files = solved_files(task)
        yield task.id, "\n".join(f"# file: {p}\n{files[p].rstrip()}\n" for p in sorted(files))
