"""Grading: hidden tests over a copy of the finished workspace, and anti-cheat.

`grade` copies the workspace, writes the hidden tests over the copy, runs the task's test
command there (through a `Sandbox`: bubblewrap when a sandbox is asked for, else a plain
process group with the same timeout handling) and checks exit 0 plus, when the task says so,
an expected pattern in the output (for generated tasks pytest's summary with passes only, so
an early `os._exit(0)` or skipped hidden tests do not count as a pass).

The reward is 0 when the rollout cheated, whatever the tests say:
- tampering, seen by comparing the workspace with the starting files: a test file, conftest,
  pytest configuration (pytest.ini, tox.ini, setup.cfg, pyproject.toml) or a file the test
  command names was deleted or changed; a conftest, configuration, `*.pth` or a module that
  shadows the test runner (`pytest.py`, `sitecustomize.py` ...) was added; a test file gained
  skips, xfails, hooks, `sys.modules`/`setattr` patching or exits; package code started to
  reference pytest or exit the interpreter; a symlink leads out of the workspace. Adding new
  tests, or new test functions to an existing test file, is fine.
- peeking: a tool call names a hidden test file or the task folder, or a tool result shows a
  line of hidden test code.
This module does not decide what a reward is used for, and it never runs the agent.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

CONFIG_FILES = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                "pyproject.toml"}
SHADOWS = {"pytest", "_pytest", "py", "pluggy", "sitecustomize", "usercustomize", "unittest"}
SKIP_DIRS = {"__pycache__", ".pytest_cache"}
# what a test file must not gain: skips, xfails, hooks, patching of modules, early exits
TEST_CHEATS = re.compile(
    r"pytest\.skip|mark\.skip|skipif|xfail|unittest\.skip|pytestmark|collect_ignore|"
    r"def\s+pytest_\w+|sys\.modules|(?<!monkeypatch\.)setattr\s*\(|__code__|builtins|"
    r"importlib\.reload|"
    r"os\._exit|\bexit\s*\(")
# what package code must not gain: knowledge of the test runner, exits, interpreter hooks
CODE_CHEATS = re.compile(r"\bpytest\b|_pytest|os\._exit|sys\.modules|__builtins__|"
                         r"\bbuiltins\b|__code__|sys\.settrace|sys\.setprofile|atexit")
READ_TOOLS_SKIP = {"write_file", "edit_file", "finish"}
MIN_HIDDEN_LINE = 24                           # shorter lines are too generic to prove a peek
OUTPUT_TAIL = 4000


@dataclass
class Grade:
    reward: float                              # 1.0 solved honestly, else 0.0
    passed: bool                               # the hidden tests passed (cheating or not)
    cheated: bool
    detail: str                                # one line: why
    violations: list[str] = field(default_factory=list)
    output: str = ""                           # tail of the test command's output
    exit_code: int | None = None
    duration_s: float = 0.0
    tests: tuple[int, int] | None = None       # (passed, run) from pytest's summary, if any

    @property
    def share(self) -> float | None:
        """The share of the tests run that passed (collection errors count as failures),
        or None when the output has no pytest summary."""
        if self.tests is None:
            return None
        passed, run = self.tests
        return passed / run if run else 0.0


def grade(task, workspace: Path, sandbox=None, transcript=None) -> Grade:
    """Grade the finished `workspace` of `task`. `sandbox`: None runs the tests as a plain
    process group; a `Sandbox`/`SandboxConfig` (or True for the default config) runs them
    sandboxed. `transcript`: the session's tool calls (store rows) or messages, for peeks."""
    start = time.monotonic()
    workspace = Path(workspace)
    violations = tampering(task, workspace) + peeks(task, transcript)
    with tempfile.TemporaryDirectory(prefix="apprentice-grade-") as tmp:
        copy = Path(tmp) / "workspace"
        shutil.copytree(workspace, copy, symlinks=True, ignore=_not_copied)
        violations += _drop_escaping_links(copy)
        _write_hidden(copy, task.hidden_tests)
        with make_sandbox(copy, sandbox_config(task, sandbox)) as box:
            result = box.run(task.test_command, timeout=task.timeout)
    output = result.output[-OUTPUT_TAIL:]
    passed = result.exit_code == 0 and not result.timed_out and (
        not task.expect_output or re.search(task.expect_output, result.output) is not None)
    cheated = bool(violations)
    if cheated:
        detail = "cheated: " + "; ".join(violations[:5])
    elif passed:
        detail = "passed"
    elif result.timed_out:
        detail = f"tests timed out after {task.timeout:g} s"
    else:
        last = next((ln for ln in reversed(result.output.strip().splitlines()) if ln.strip()), "")
        detail = f"tests failed (exit {result.exit_code}): {last[:200]}"
    return Grade(1.0 if passed and not cheated else 0.0, passed, cheated, detail, violations,
                 output, result.exit_code, time.monotonic() - start, test_counts(result.output))


SUMMARY = re.compile(r"^=*\s*(?:\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|"
                     r"xpassed|warnings?)(?:, )?)+ in [\d.]+s", re.M)


def test_counts(output: str) -> tuple[int, int] | None:
    """(passed, run) from the last pytest summary line of `output` ("2 failed, 3 passed in
    0.05s", "1 error in 0.2s"; failures and errors both count as run), or None without one."""
    lines = SUMMARY.findall(output)
    if not lines:
        return None
    counts = {word.rstrip("s"): int(n) for n, word in
              re.findall(r"(\d+) (passed|failed|errors?)", lines[-1])}
    passed = counts.get("passed", 0)
    return passed, passed + counts.get("failed", 0) + counts.get("error", 0)


# ---------------------------------------------------------------- running the tests

def task_env(task) -> dict[str, str]:
    """The task's environment, with this interpreter's bin folder first on PATH, so `python`
    in a task command is the Python that runs apprentice (pytest included)."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin"
    return {**task.env, "PATH": f"{bin_dir}{os.pathsep}{path}"}


CLOCK_PLUGINS = Path(__file__).parent / "clock"    # `apprentice_fixed_clock`, a pytest plugin


def fixed_clock(config):
    """`config` (a SandboxConfig) with pytest's clock standing still in its commands
    (`clock/apprentice_fixed_clock.py`: every run reports "in 0.00s"), for evaluations: the
    durations pytest prints are the one part of a task's tool output that differs between two
    runs of the same model, and a model reads them (two held-out evaluations of the shipped
    model, with the same logits call for call, had 76 of 200 transcripts part at them)."""
    from dataclasses import replace
    plugins = str(CLOCK_PLUGINS)
    path = config.env.get("PYTHONPATH")
    return replace(config, env={**config.env, "PYTEST_PLUGINS": "apprentice_fixed_clock",
                                "PYTHONPATH": plugins + (os.pathsep + path if path else "")},
                   readonly_paths=(*config.readonly_paths, plugins))


def as_sandbox_config(sandbox, default=None):
    """The SandboxConfig `sandbox` names: a Sandbox's own, a SandboxConfig, a mode string,
    True (the default config); None gives `default` (None: unsandboxed)."""
    from agent_runtime.sandbox import Sandbox, SandboxConfig
    if sandbox is None:
        return default if default is not None else SandboxConfig(mode="off")
    if isinstance(sandbox, Sandbox):
        return sandbox.config
    if isinstance(sandbox, SandboxConfig):
        return sandbox
    if isinstance(sandbox, str):
        return SandboxConfig(mode=sandbox)
    if sandbox is True:
        return SandboxConfig()
    raise TypeError(f"sandbox: expected a Sandbox, SandboxConfig, mode string, True or None, "
                    f"not {sandbox!r}")


def sandbox_config(task, sandbox=None):
    """The SandboxConfig commands of `task` run under: `sandbox` (`as_sandbox_config`: None
    is unsandboxed), with the task's environment on top."""
    from dataclasses import replace
    config = as_sandbox_config(sandbox)
    return replace(config, env={**config.env, **task_env(task)},
                   max_timeout=max(config.max_timeout, float(task.timeout)))


_probe_lock = threading.Lock()
_bwrap_works: bool | None = None               # one probe per process


def make_sandbox(workspace: Path, config):
    """A `Sandbox` for `workspace`. Bubblewrap is probed once per process, not per sandbox:
    "auto" then runs sandboxed without a new probe, or unsandboxed after one warning."""
    global _bwrap_works
    from agent_runtime.sandbox import Sandbox
    if config.mode != "off":
        with _probe_lock:
            if _bwrap_works is None:
                with tempfile.TemporaryDirectory(prefix="apprentice-probe-") as tmp:
                    with Sandbox(tmp, config) as box:
                        _bwrap_works = box.probe()     # "require" raises here when it fails
    box = Sandbox(workspace, config)
    if config.mode == "off" or not _bwrap_works:
        box.probed, box.sandboxed = True, False   # unsandboxed by request, or warned once
    else:
        box.probed, box.sandboxed = True, True
        box.process_limit = "rlimit" if os.geteuid() != 0 else None
    return box


def _not_copied(folder: str, names: list[str]) -> set[str]:
    """Caches, and what is neither a file, a folder nor a link (a FIFO would hang the copy)."""
    out = set()
    for name in names:
        path = os.path.join(folder, name)
        if name in SKIP_DIRS or not (os.path.islink(path) or os.path.isfile(path)
                                     or os.path.isdir(path)):
            out.add(name)
    return out


def _write_hidden(root: Path, hidden: dict[str, str | bytes]) -> None:
    for rel, content in hidden.items():
        path = root / rel
        for parent in reversed(path.relative_to(root).parents[:-1]):
            p = root / parent
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                p.unlink()
            p.mkdir(exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def _drop_escaping_links(root: Path) -> list[str]:
    found = []
    real_root = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                target = os.path.realpath(path)
                if target != real_root and not target.startswith(real_root + os.sep):
                    found.append(f"symlink {path.relative_to(root).as_posix()} leaves the workspace")
                    path.unlink()
    return found


# ---------------------------------------------------------------- tampering

def is_test_file(rel: str) -> bool:
    p = PurePosixPath(rel)
    return p.suffix == ".py" and (p.name.startswith("test_") or p.stem.endswith("_test")
                                  or any(part in ("tests", "test") for part in p.parts[:-1]))


def protected_files(task) -> dict[str, str]:
    """Starting files whose change is tampering: path -> "strict" or "tests" (may grow)."""
    named = set()
    try:
        named = {t.strip("./") for t in shlex.split(task.test_command)}
    except ValueError:
        pass
    out = {}
    for rel in task.files:
        name = PurePosixPath(rel).name
        if name in CONFIG_FILES or rel.strip("./") in named:
            out[rel] = "strict"
        elif is_test_file(rel) and name != "__init__.py":
            out[rel] = "tests"
    return out


def tampering(task, workspace: Path) -> list[str]:
    """Ways the finished workspace has tampered with tests or the test setup."""
    found = []
    for rel, kind in protected_files(task).items():
        path = workspace / rel
        if not path.is_file():
            found.append(f"deleted {rel}")
            continue
        old, new = _text(task.files[rel]), _text(path.read_bytes())
        if old == new:
            continue
        if kind == "strict" or not _extends(old, new):
            found.append(f"modified {rel}")
    for rel in _walk(workspace):
        if rel in task.files:
            if rel.endswith(".py") and not is_test_file(rel):
                old, new = _text(task.files[rel]), _text((workspace / rel).read_bytes())
                if _gained(CODE_CHEATS, old, new):
                    found.append(f"{rel} now reaches into the test runner or the interpreter")
            continue
        p = PurePosixPath(rel)
        if p.name in CONFIG_FILES or p.suffix == ".pth":
            found.append(f"added {rel}")
        elif p.parts[0].removesuffix(".py") in SHADOWS and (len(p.parts) > 1 or p.suffix == ".py"):
            found.append(f"added {rel}, which shadows {p.parts[0].removesuffix('.py')}")
        elif p.suffix == ".py":
            text = _text((workspace / rel).read_bytes())
            cheats = TEST_CHEATS if is_test_file(rel) else CODE_CHEATS
            if cheats.search(text) or (is_test_file(rel) and _patches_modules(text)):
                found.append(f"added {rel}, which skips or patches tests")
    return found


def _walk(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and d != ".git"]
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file():                 # regular files (through links): no FIFOs
                out.append(path.relative_to(root).as_posix())
    return sorted(out)


def _text(content: str | bytes) -> str:
    return content if isinstance(content, str) else content.decode("utf-8", "replace")


def _gained(pattern: re.Pattern, old: str, new: str) -> bool:
    return len(pattern.findall(new)) > len(pattern.findall(old))


def _extends(old: str, new: str) -> bool:
    """Whether `new` keeps every top-level statement of the test file `old` (imports may
    change) and adds no skip, hook, patching or exit."""
    try:
        old_tree, new_tree = ast.parse(old), ast.parse(new)
    except SyntaxError:
        return False
    kept = {ast.dump(node) for node in new_tree.body}
    for node in old_tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) and ast.dump(node) not in kept:
            return False
    return not _gained(TEST_CHEATS, old, new) and \
        _patches_modules(new) <= _patches_modules(old)


def _patches_modules(text: str) -> int:
    """How many assignments write an attribute of an imported module (`mod.f = ...`)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return 0
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules |= {a.asname or a.name for a in node.names}
    count = 0
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if t is not base and isinstance(base, ast.Name) and base.id in modules:
                count += 1
    return count


# ---------------------------------------------------------------- peeking

def peeks(task, transcript) -> list[str]:
    """Tool calls that tried to read the hidden tests, and results that showed them (for a
    task on disk: lines of hidden test code the agent did not write itself)."""
    if not transcript:
        return []
    markers = set()
    for rel in task.hidden_tests:
        if rel not in task.files:
            markers |= {rel, PurePosixPath(rel).name}
    if task.source:
        markers.add(str(task.source))
    calls = _calls(transcript)
    lines = _hidden_lines(task) if task.source else set()
    written = "\n".join(json.dumps(a) if not isinstance(a, str) else a
                        for n, a, _ in calls if n in ("write_file", "edit_file"))
    lines = {line for line in lines if json.dumps(line)[1:-1] not in written}
    found = []
    for name, arguments, result in calls:
        if name not in READ_TOOLS_SKIP:
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            hit = next((m for m in markers if m in text), None)
            if hit:
                found.append(f"{name} tried to read hidden tests ({hit})")
                continue
        if result and any(line in result for line in lines):
            found.append(f"{name} showed hidden test code")
    return found


def _hidden_lines(task) -> set[str]:
    seen = {line.strip() for content in task.files.values() for line in
            _text(content).splitlines()}
    return {line.strip() for content in task.hidden_tests.values()
            for line in _text(content).splitlines()
            if len(line.strip()) >= MIN_HIDDEN_LINE and line.strip() not in seen}


def _calls(transcript) -> list[tuple[str, Any, str]]:
    """(name, arguments, result) from store tool-call rows or chat messages."""
    out = []
    for item in transcript:
        if not isinstance(item, dict):
            continue
        if "arguments" in item and "name" in item:              # a store tool_calls row
            out.append((item["name"], item["arguments"], item.get("result") or ""))
        elif item.get("role") == "assistant":
            for c in item.get("tool_calls") or []:
                fn = c.get("function", c)
                out.append((fn.get("name"), fn.get("arguments"), ""))
        elif item.get("role") == "tool":
            out.append((item.get("name") or "tool", "", item.get("content") or ""))
    return out
