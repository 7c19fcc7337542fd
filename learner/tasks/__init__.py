"""Simulated coding tasks with verifiable rewards, and bring-your-own task folders.

A `TaskInstance` is a tiny repository (`files`), an instruction, and hidden tests that are
never in the agent's workspace: `grade` copies them over a copy of the finished workspace and
runs `test_command` there. `generate(split, n, seed)` draws instances from six families
(`FAMILIES`), each in its own module, deterministically: the same arguments give the same
instances, byte for byte. Train and held-out splits differ by seed range and by phrasings,
kernels and domains held out of training. Every generated instance carries a `solution` for
the oracle (`learner.tasks.oracle.OraclePolicy`), which solves it through the normal tools.

This package does not run agents; `learner.rollout` does, and `learner.eval` reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from learner.tasks import add_feature, fix_bug, fix_command, fix_import, implement, rename
from learner.tasks.repo import TEST_COMMAND, TEST_ENV, TEST_EXPECT, Context, Retry

_FAMILY_MODULES = {m.NAME: m for m in (fix_bug, implement, rename, fix_import, fix_command,
                                       add_feature)}
FAMILIES: list[str] = list(_FAMILY_MODULES)
SPLITS = ("train", "heldout")
SPLIT_BASE = {"train": 0, "heldout": 1_000_000_000}   # instance seeds never overlap
PER_SEED = 1_000_000                                   # instance numbers per generate() seed
MAX_ATTEMPTS = 30


@dataclass
class TaskInstance:
    id: str                                    # "fix_bug/train/123", or a folder's name
    family: str                                # a FAMILIES entry, or "folder"
    split: str                                 # "train" | "heldout" (folders: "folder")
    difficulty: int                            # 1..3 (folders: 0)
    instruction: str
    files: dict[str, str | bytes] = field(repr=False)        # starting workspace
    hidden_tests: dict[str, str | bytes] = field(repr=False)  # copied in only for grading
    test_command: str = TEST_COMMAND           # run in the graded copy; exit 0 = solved
    timeout: float = 60.0                      # seconds the test command may take
    solution: Any = field(default=None, repr=False)   # the oracle's plan; never shown
    env: dict[str, str] = field(default_factory=dict)  # extra environment for commands
    expect_output: str | None = None           # regex the test output must also match
    meta: dict[str, Any] = field(default_factory=dict)  # kernel, bug kind, template ...
    source: str | None = None                  # the task folder it was loaded from

    def materialize(self, workspace: Path) -> None:
        """Write the starting files into `workspace` (created if missing)."""
        root = Path(workspace)
        root.mkdir(parents=True, exist_ok=True)
        for rel, content in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8")


def generate(split: str, n: int, seed: int = 0, families: list[str] | None = None,
             difficulty: int | None = None, phrasings: float = 0.0) -> list[TaskInstance]:
    """`n` instances of `split`, families taken in turn; deterministic in all arguments.
    `phrasings`: the share of training instances whose instruction is composed from parts
    (`repo.phrase`) instead of one of the family's fixed sentences; the repositories are the
    same either way."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in _FAMILY_MODULES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if not 0 <= n <= PER_SEED:
        raise ValueError(f"n must be between 0 and {PER_SEED}")
    return [make_instance(families[j % len(families)], split, seed * PER_SEED + j, difficulty,
                          phrasings) for j in range(n)]


def make_instance(family: str, split: str, number: int, difficulty: int | None = None,
                  phrasings: float = 0.0) -> TaskInstance:
    """Instance `number` of `family` in `split` (its id names it: see `instance_from_id`)."""
    if difficulty is not None and difficulty not in (1, 2, 3):
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty!r}")
    module = _FAMILY_MODULES[family]
    base = SPLIT_BASE[split] + number
    for attempt in range(MAX_ATTEMPTS):
        rng = Random(f"{family}:{base}:{attempt}")
        level = difficulty or rng.randint(1, 3)
        ctx = Context(rng, split, level, phrasings=phrasings)
        try:
            draft = module.build(ctx)
        except Retry:
            continue
        task_id = f"{family}/{split}/{number}" + (f"/d{difficulty}" if difficulty else "")
        meta = {**draft.meta, "domain": ctx.domain.key, "package": ctx.pkg,
                "kernels_used": sorted(ctx.used_kernels), "phrase": list(ctx.phrase)}
        return TaskInstance(task_id, family, split, level, draft.instruction, draft.files,
                            draft.hidden_tests, TEST_COMMAND, 60.0, draft.solution,
                            dict(TEST_ENV), TEST_EXPECT, meta)
    raise RuntimeError(f"{family}/{split}/{number}: no valid instance in {MAX_ATTEMPTS} draws")


def instance_from_id(task_id: str) -> TaskInstance:
    """Rebuild a generated instance from its id, e.g. "fix_bug/train/123" or ".../123/d2"."""
    m = re.fullmatch(r"(\w+)/(train|heldout)/(\d+)(?:/d([123]))?", task_id)
    if m is None or m.group(1) not in _FAMILY_MODULES:
        raise ValueError(f"not a generated task id: {task_id!r}")
    family, split, number, level = m.groups()
    return make_instance(family, split, int(number), int(level) if level else None)


from learner.tasks.folder import export, load_task_folder, load_tasks  # noqa: E402
from learner.tasks.grading import Grade, grade                           # noqa: E402

__all__ = ["TaskInstance", "generate", "make_instance", "instance_from_id", "FAMILIES",
           "SPLITS", "Retry", "load_task_folder", "load_tasks", "export", "Grade", "grade"]
