"""Sandbox properties, one per test, with real processes.

Tests of what only bubblewrap gives (writes outside the workspace refused, no network) skip
when bwrap cannot run here; the others run both sandboxed and on the unsandboxed fallback.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import pytest

from agent_runtime.sandbox import Sandbox, SandboxConfig, SandboxUnavailable


def _alive(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (seen from outside any namespace)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _gone(marker: str, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _marker() -> str:
    return str(secrets.randbelow(10**12)).rjust(12, "7")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def session_dir(tmp_path: Path) -> Path:
    return tmp_path / "session"


@pytest.fixture
def bwrap_sandbox(workspace, session_dir):
    """A factory for sandboxes that really run under bubblewrap (skips when it cannot)."""
    made = []

    def make(**config) -> Sandbox:
        sb = Sandbox(workspace, SandboxConfig(mode="auto", **config), session_dir=session_dir)
        made.append(sb)
        if not sb.probe():
            pytest.skip(f"bubblewrap cannot run here: {sb.warning}")
        return sb

    yield make
    for sb in made:
        sb.close()


@pytest.fixture(params=["bwrap", "fallback"])
def any_sandbox(request, workspace, session_dir, bwrap_sandbox):
    """A factory for sandboxes in both modes: bubblewrap, and the unsandboxed fallback."""
    made = []

    def make(**config) -> Sandbox:
        if request.param == "bwrap":
            return bwrap_sandbox(**config)
        sb = Sandbox(workspace, SandboxConfig(mode="off", **config), session_dir=session_dir)
        made.append(sb)
        sb.probe()
        return sb

    yield make
    for sb in made:
        sb.close()


def test_write_outside_workspace_is_refused(bwrap_sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    res = bwrap_sandbox().run(f"echo leaked > {outside}/file.txt")
    assert res.exit_code != 0
    assert not (outside / "file.txt").exists()


def test_write_to_system_paths_is_refused(bwrap_sandbox):
    target = Path.home() / f".apprentice-sandbox-test-{_marker()}"
    res = bwrap_sandbox().run(f"echo leaked > {target}")
    assert res.exit_code != 0
    assert not target.exists()


def test_workspace_is_writable(bwrap_sandbox, workspace):
    res = bwrap_sandbox().run("mkdir -p sub && echo hello > sub/inside.txt")
    assert res.exit_code == 0, res.output
    assert (workspace / "sub" / "inside.txt").read_text() == "hello\n"


def test_commands_see_the_workspace_at_one_fixed_path(bwrap_sandbox, workspace):
    (workspace / "pkg").mkdir()
    (workspace / "pkg" / "mod.py").write_text("raise ValueError('boom')\n")
    sb = bwrap_sandbox()
    res = sb.run("pwd; python3 pkg/mod.py")
    assert res.output.startswith("/workspace\n") and 'File "/workspace/pkg/mod.py"' in res.output
    assert sb.run("pwd", cwd=workspace / "pkg").output == "/workspace/pkg\n"
    res = sb.run(f"echo a > /workspace/a.txt && echo b > {workspace}/b.txt && cat /workspace/b.txt")
    assert res.exit_code == 0 and res.output == "b\n", res.output
    assert (workspace / "a.txt").read_text() == "a\n"
    assert sb.run("touch /new-file-at-the-root").exit_code != 0


def test_without_a_mount_commands_see_the_workspace_at_its_own_path(bwrap_sandbox, workspace):
    assert bwrap_sandbox(mount=None).run("pwd").output == f"{workspace.resolve()}\n"


def test_network_is_refused(bwrap_sandbox):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        probe = (f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                 " print('CONNECTED')\nexcept OSError as e:\n print('REFUSED', e)")
        res = bwrap_sandbox().run(f"{sys.executable} -c \"{probe}\"")
        assert "REFUSED" in res.output and "CONNECTED" not in res.output, res.output
    finally:
        server.close()


def test_only_loopback_interface_inside(bwrap_sandbox):
    res = bwrap_sandbox().run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert res.output.split() == ["lo"]


def test_sleep_past_timeout_is_killed_with_its_children(any_sandbox):
    m = _marker()
    res = any_sandbox().run(f"sleep 60.{m}1 & sleep 60.{m}2 & sleep 60.{m}3; echo never", timeout=1)
    assert res.timed_out
    assert "never" not in res.output
    assert _gone(m), f"still alive: {_alive(m)}"


def test_background_child_does_not_hold_the_call(any_sandbox):
    m = _marker()
    res = any_sandbox().run(f"sleep 60.{m} & echo started", timeout=30)
    assert not res.timed_out and res.exit_code == 0
    assert res.output == "started\n"
    assert _gone(m)


def test_output_bomb_is_truncated_with_full_output_saved(any_sandbox, session_dir):
    sb = any_sandbox(output_cap=10_000)
    res = sb.run("echo START-MARK; head -c 3000000 /dev/zero | tr '\\0' x; echo; echo END-MARK")
    assert res.exit_code == 0 and res.truncated
    assert res.output.startswith("START-MARK") and res.output.endswith("END-MARK\n")
    assert len(res.output) < 11_000
    assert res.full_output_path is not None and session_dir in res.full_output_path.parents
    saved = res.full_output_path.read_bytes()
    assert len(saved) == res.total_bytes > 3_000_000 and saved.endswith(b"END-MARK\n")


def test_endless_output_is_bounded_in_memory_and_on_disk(any_sandbox):
    sb = any_sandbox(output_cap=10_000, full_output_cap=1_000_000)
    res = sb.run("yes apprentice", timeout=1)
    assert res.timed_out and res.truncated
    assert len(res.output) < 11_000
    assert res.full_output_path.stat().st_size <= 1_000_000


def test_fork_bomb_is_contained(any_sandbox):
    sb = any_sandbox(max_processes=64)
    if sb.process_limit is None:
        pytest.skip("no process-count limit here (root without a writable pids cgroup)")
    m = _marker()
    t0 = time.monotonic()
    res = sb.run(f":(){{ :|:& }};:; sleep 30 # {m}", timeout=2)
    assert time.monotonic() - t0 < 30
    assert "Resource temporarily unavailable" in res.output
    assert _gone(m), f"{len(_alive(m))} fork bomb processes survived"


def test_memory_limit_applies(any_sandbox):
    res = any_sandbox(memory_limit=512 * 2**20).run(
        f"{sys.executable} -c 'bytearray(2 * 1024**3)'")
    assert res.exit_code != 0
    assert "MemoryError" in res.output


def test_exit_code_is_returned(any_sandbox):
    assert any_sandbox().run("echo out; echo err >&2; exit 3").exit_code == 3


def test_running_python_leaves_no_bytecode_cache_in_the_workspace(any_sandbox, workspace):
    (workspace / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    res = any_sandbox().run("python3 -c 'import calc; print(calc.add(2, 3))'")
    assert res.output.strip() == "5"
    assert not list(workspace.rglob("__pycache__")) and not list(workspace.rglob("*.pyc"))


def test_environment_does_not_leak_secrets(any_sandbox, monkeypatch):
    monkeypatch.setenv("APPRENTICE_TEST_SECRET", "hunter2")
    res = any_sandbox().run("env")
    assert "PATH=" in res.output
    assert "hunter2" not in res.output


def test_tmp_is_private_and_kept_between_commands(bwrap_sandbox):
    sb = bwrap_sandbox()
    name = f"apprentice-{_marker()}"
    assert sb.run(f"echo kept > /tmp/{name}").exit_code == 0
    assert sb.run(f"cat /tmp/{name}").output == "kept\n"
    assert not Path("/tmp", name).exists()


def test_readonly_paths_are_seen_even_under_tmp_and_not_written(bwrap_sandbox, tmp_path):
    """The sandbox hides the host's /tmp behind its own; a read-only path under it (a CI
    clone's plugin folder) is still seen, and cannot be written."""
    shared = tmp_path / "plugins"
    shared.mkdir()
    (shared / "note.txt").write_text("seen\n")
    assert bwrap_sandbox().run(f"cat {shared}/note.txt").exit_code != 0   # hidden without it
    sb = bwrap_sandbox(readonly_paths=(str(shared),))
    assert sb.run(f"cat {shared}/note.txt").output == "seen\n"
    assert sb.run(f"echo changed > {shared}/note.txt").exit_code != 0
    assert (shared / "note.txt").read_text() == "seen\n"


def test_fallback_warns_the_user(workspace, caplog):
    with caplog.at_level(logging.WARNING, logger="agent_runtime.sandbox"):
        sb = Sandbox(workspace, SandboxConfig(mode="off"))
        assert sb.probe() is False
    assert sb.warning and "WITHOUT a sandbox" in sb.warning
    assert any("WITHOUT a sandbox" in r.getMessage() for r in caplog.records)
    res = sb.run("echo still works")
    assert res.output == "still works\n" and not res.sandboxed
    sb.close()


def test_missing_bwrap_falls_back_with_warning(workspace):
    sb = Sandbox(workspace, SandboxConfig(mode="auto", bwrap="/nonexistent/bwrap"))
    assert sb.probe() is False
    assert "bubblewrap" in sb.warning
    assert sb.run("echo ok").output == "ok\n"
    sb.close()


def test_require_mode_refuses_to_fall_back(workspace):
    sb = Sandbox(workspace, SandboxConfig(mode="require", bwrap="/nonexistent/bwrap"))
    with pytest.raises(SandboxUnavailable):
        sb.probe()
    sb.close()


def test_env_var_switches_the_sandbox_off(workspace, monkeypatch):
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    sb = Sandbox(workspace)
    assert sb.probe() is False and sb.warning
    sb.close()


def test_sandbox_failure_after_probe_reruns_unsandboxed_with_warning(workspace, tmp_path, caplog):
    extra = tmp_path / "extra"
    extra.mkdir()
    sb = Sandbox(workspace, SandboxConfig(mode="auto", writable_paths=(str(extra),)))
    if not sb.probe():
        pytest.skip(f"bubblewrap cannot run here: {sb.warning}")
    extra.rmdir()                                  # bwrap can no longer set up its mounts
    with caplog.at_level(logging.WARNING, logger="agent_runtime.sandbox"):
        res = sb.run("echo ran")
    assert res.output == "ran\n" and res.exit_code == 0 and not res.sandboxed
    assert res.warning and "bubblewrap stopped working" in res.warning
    assert not sb.sandboxed and sb.warning == res.warning
    assert any("WITHOUT a sandbox" in r.getMessage() for r in caplog.records)
    sb.close()
