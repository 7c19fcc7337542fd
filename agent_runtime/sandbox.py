"""Run shell commands for the agent: in a bubblewrap sandbox when one works, else unsandboxed.

`Sandbox.probe()` starts a trivial command under `bwrap` with the real flags (read-only root,
writable workspace and private /tmp, new user/pid/net/ipc/uts namespaces, dies with its
parent). When that fails, or the sandbox is switched off (`SandboxConfig.mode`, or
`APPRENTICE_SANDBOX=off`), commands run unsandboxed and `Sandbox.warning` says so, for the UI
to show the user; the warning is also logged. The model never sees a sandbox failure as a
tool error: if bwrap fails before the command starts, the command runs again unsandboxed.

Every command runs in a new session. On timeout the whole process group is killed, and with
it bwrap's pid namespace. Output (stdout and stderr merged) is read as it comes: past the cap
only the head and the tail are kept in memory, the full output goes to a file in the session
folder. Address space and process count are limited per command: process count through a
per-command `pids` cgroup where this process may create one (root), else RLIMIT_NPROC set
inside the sandbox's user namespace (which the kernel ignores for root). Commands see a
minimal environment (PATH, HOME, LANG, TERM, ...), never the user's secrets; Python writes
no bytecode caches (PYTHONDONTWRITEBYTECODE; installed packages' caches are still read), so
running tests leaves no `__pycache__` folders in the workspace.

Inside the sandbox the workspace is also at one fixed path, `/workspace` (`SandboxConfig.mount`,
as OpenHands mounts its workspace), and commands start there: a traceback, `pwd` or a test
report names `/workspace/pkg/mod.py` whatever folder the user works in, the same paths the
model saw in training (the tools accept `/workspace/...` as a workspace path). The workspace
stays writable at its own path too, for files that name it. The sandbox's root is a fresh
read-only tree of the host's top-level folders, so that the mount point can be made.

This module does not parse commands, ask the user for approval, or keep shell state between
commands (each command is a fresh `bash -c`; only files in the workspace and /tmp persist).
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MODES = ("auto", "off", "require")
MOUNT = "/workspace"          # where commands see the workspace inside the sandbox
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_EXIT_GRACE_S = 0.3          # how long to keep reading after the shell exits (stragglers)
_PROBE_TIMEOUT_S = 20.0


class SandboxUnavailable(RuntimeError):
    """mode="require" and bubblewrap cannot run here."""


@dataclass
class SandboxConfig:
    # "auto": bubblewrap when it works, else unsandboxed with a warning; "off": never sandbox
    # (still warns); "require": raise SandboxUnavailable instead. Default: $APPRENTICE_SANDBOX.
    mode: str = field(default_factory=lambda: os.environ.get("APPRENTICE_SANDBOX") or "auto")
    timeout: float = 120.0                 # seconds a command may run when no timeout is given
    max_timeout: float = 600.0             # upper bound on any requested timeout, seconds
    output_cap: int = 30_000               # bytes of output returned; past it, head + tail halves
    full_output_cap: int = 64 * 2**20      # most bytes of a truncated output saved to a file
    memory_limit: int | None = 8 * 2**30   # address space (RLIMIT_AS) per process, bytes
    max_processes: int | None = 1024       # processes (cgroup: tasks) alive at once per command
    writable_paths: tuple[str, ...] = ()   # host paths writable besides workspace and /tmp
    readonly_paths: tuple[str, ...] = ()   # host paths commands must see (read-only), even
                                           # under the host's /tmp, which the sandbox hides
    mount: str | None = MOUNT              # the workspace's path inside the sandbox, where
                                           # commands start (None: its host path)
    network: bool = False                  # share the host network (off: private loopback only)
    bwrap: str = "bwrap"                   # bubblewrap executable, on PATH or a path
    shell: str | None = None               # runs `SHELL -c COMMAND`; default bash, else sh
    env: dict[str, str] = field(default_factory=dict)   # extra environment for commands


@dataclass
class CommandResult:
    exit_code: int                     # 128+N when killed by signal N (137 after a timeout)
    output: str                        # stdout+stderr merged; head and tail when truncated
    timed_out: bool = False
    truncated: bool = False
    full_output_path: Path | None = None   # the whole output, when truncated
    total_bytes: int = 0               # bytes of output the command produced
    duration: float = 0.0              # seconds
    sandboxed: bool = False
    warning: str | None = None         # set when this call had to fall back (for the UI)


class _NotStarted(Exception):
    """bwrap exited before the command ran: the sandbox itself failed."""


class Sandbox:
    """Runs commands for one workspace (one agent session)."""

    def __init__(self, workspace: str | os.PathLike, config: SandboxConfig | None = None,
                 session_dir: str | os.PathLike | None = None):
        self.workspace = Path(os.path.realpath(workspace))
        self.config = config or SandboxConfig()
        if self.config.mode not in MODES:
            raise ValueError(f"SandboxConfig.mode must be one of {MODES}, not {self.config.mode!r}")
        self.session_dir = Path(session_dir) if session_dir is not None else None
        self.sandboxed = False
        self.warning: str | None = None
        self.probed = False
        self.process_limit: str | None = None   # "cgroup", "rlimit" or None (not enforced)
        self._bwrap = shutil.which(self.config.bwrap)
        self._shell = self.config.shell or shutil.which("bash") or "/bin/sh"
        self._lock = threading.Lock()
        self._tmp = Path(tempfile.mkdtemp(prefix="apprentice-tmp-"))
        self._home = self._tmp / "home"
        self._home.mkdir()
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._tmp), True)

    # ------------------------------------------------------------ lifecycle

    def probe(self) -> bool:
        """Decide whether commands run sandboxed; returns `self.sandboxed`."""
        with self._lock:
            if self.probed:
                return self.sandboxed
            self.probed = True
            self.process_limit = "cgroup" if _pids_cgroup_root() else (
                "rlimit" if os.geteuid() != 0 else None)
            if self.config.max_processes is None:
                self.process_limit = None
            reason = self._probe_bwrap()
            if reason is None:
                self.sandboxed = True
                return True
            if self.config.mode == "require":
                raise SandboxUnavailable(reason)
            self._fall_back(reason)
            return False

    def _probe_bwrap(self) -> str | None:
        if self.config.mode == "off":
            return "the sandbox is switched off (APPRENTICE_SANDBOX=off or mode='off')"
        if not self._bwrap:
            return (f"bubblewrap (`{self.config.bwrap}`) is not installed; install it "
                    "(e.g. `apt install bubblewrap`) to isolate commands")
        marker = "apprentice-sandbox-ok"
        try:
            res = self._execute(f"echo {marker}", self.workspace, _PROBE_TIMEOUT_S, sandboxed=True)
        except _NotStarted as e:
            return f"bubblewrap cannot create a sandbox here: {e}"
        except OSError as e:
            return f"bubblewrap could not be started: {e}"
        if res.exit_code != 0 or marker not in res.output:
            return f"bubblewrap's test command failed (exit {res.exit_code}): {res.output.strip()[:300]}"
        return None

    def _fall_back(self, reason: str) -> None:
        self.sandboxed = False
        self.warning = f"Commands run WITHOUT a sandbox, with your permissions: {reason}."
        log.warning("%s", self.warning)

    def close(self) -> None:
        """Remove this sandbox's private /tmp."""
        self._finalizer()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ running

    def run(self, command: str, cwd: str | os.PathLike | None = None,
            timeout: float | None = None) -> CommandResult:
        """Run `command` with the shell in `cwd` (default: the workspace root)."""
        if not self.probed:
            self.probe()
        cwd = Path(os.path.realpath(cwd or self.workspace))
        if cwd != self.workspace and self.workspace not in cwd.parents:
            raise ValueError(f"cwd {cwd} is outside the workspace {self.workspace}")
        if not cwd.is_dir():
            raise ValueError(f"cwd {cwd} is not a directory")
        timeout = min(float(timeout or self.config.timeout), self.config.max_timeout)
        if self.sandboxed:
            try:
                return self._execute(command, cwd, timeout, sandboxed=True)
            except _NotStarted as e:
                if self.config.mode == "require":
                    raise SandboxUnavailable(str(e)) from None
                with self._lock:
                    self._fall_back(f"bubblewrap stopped working: {e}")
                res = self._execute(command, cwd, timeout, sandboxed=False)
                res.warning = self.warning
                return res
        return self._execute(command, cwd, timeout, sandboxed=False)

    def _env(self, sandboxed: bool) -> dict[str, str]:
        tmp = "/tmp" if sandboxed else str(self._tmp)
        env = {"PATH": os.environ.get("PATH") or DEFAULT_PATH,
               "HOME": tmp if sandboxed else str(self._home),
               "TMPDIR": tmp,
               "LANG": os.environ.get("LANG") or "C.UTF-8",
               "TERM": "dumb", "NO_COLOR": "1", "PAGER": "cat", "GIT_PAGER": "cat",
               "PYTHONUNBUFFERED": "1",
               # no __pycache__ written into the user's repo. Not PYTHONPYCACHEPREFIX: it moves
               # the *reading* of every cache too, so the standard library and pytest were
               # compiled again on every command (0.6 s of a 1.0 s test run)
               "PYTHONDONTWRITEBYTECODE": "1"}
        for name in ("LC_ALL", "LC_CTYPE", "TZ"):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self.config.env)
        return env

    def _argv(self, command: str, cwd: Path, started_fd: int, sandboxed: bool,
              cgroup: Path | None) -> list[str]:
        cfg = self.config
        limits = []
        if cfg.max_processes is not None:
            nproc = cfg.max_processes if sandboxed else cfg.max_processes + _count_own_processes()
            limits.append(f"ulimit -u {nproc} 2>/dev/null || ulimit -p {nproc} 2>/dev/null; ")
        if cfg.memory_limit is not None:
            limits.append(f"ulimit -v {cfg.memory_limit // 1024} 2>/dev/null; ")
        # Inside: tell the parent the command started, close that fd, apply limits, exec.
        inner = (f"printf s >&{started_fd}; exec {started_fd}>&-; "
                 + "".join(limits) + 'exec "$0" -c "$1"')
        argv = [self._shell, "-c", inner, self._shell, command]
        if sandboxed:
            argv = [self._bwrap, *self._bwrap_flags(cwd), "--", *argv]
        if cgroup is not None:
            argv = ["/bin/sh", "-c", '{ echo $$ > "$0"; } 2>/dev/null; exec "$@"',
                    str(cgroup / "cgroup.procs"), *argv]
        return argv

    def _bwrap_flags(self, cwd: Path) -> list[str]:
        ws, mount = str(self.workspace), self.config.mount
        flags = []
        for entry in sorted(os.scandir("/"), key=lambda e: e.name):
            path = "/" + entry.name
            if entry.name in ("proc", "dev", "tmp") or path == mount:
                continue
            if entry.is_symlink():
                flags += ["--symlink", os.readlink(path), path]
            else:
                flags += ["--ro-bind-try", path, path]
        flags += ["--dev", "/dev", "--proc", "/proc", "--bind", str(self._tmp), "/tmp"]
        # The private /tmp hides whatever lived under the host's /tmp: keep the running
        # interpreter (a venv made under /tmp, as CI clones do) visible, read-only.
        for prefix in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}):
            if prefix.startswith("/tmp/"):
                flags += ["--ro-bind", prefix, prefix]
        flags += ["--bind", ws, ws]
        if mount and mount != ws:
            flags += ["--bind", ws, mount]
            cwd = Path(mount) / cwd.relative_to(self.workspace)
        for p in self.config.writable_paths:
            real = os.path.realpath(p)
            flags += ["--bind", real, real]
        for p in self.config.readonly_paths:
            real = os.path.realpath(p)
            flags += ["--ro-bind", real, real]
        flags += ["--remount-ro", "/", "--unshare-all", "--unshare-user"]
        if self.config.network:
            flags.append("--share-net")
        flags += ["--die-with-parent", "--new-session", "--chdir", str(cwd)]
        return flags

    def _execute(self, command: str, cwd: Path, timeout: float, *,
                 sandboxed: bool) -> CommandResult:
        cfg = self.config
        cgroup = _new_pids_cgroup(cfg.max_processes) if cfg.max_processes is not None else None
        started_r, started_w = os.pipe()
        out = _Output(cfg.output_cap, cfg.full_output_cap, self._spill_dir())
        t0 = time.monotonic()
        timed_out = False
        try:
            proc = subprocess.Popen(
                self._argv(command, cwd, started_w, sandboxed, cgroup), cwd=str(cwd),
                env=self._env(sandboxed), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(started_w,))
        except BaseException:
            os.close(started_r)
            os.close(started_w)
            _remove_cgroup(cgroup)
            out.close()
            raise
        os.close(started_w)
        try:
            timed_out = _pump(proc, out, t0 + timeout)
        finally:
            _kill_group(proc.pid)
            _remove_cgroup(cgroup)
            _read_available(proc.stdout.fileno(), out)
            proc.stdout.close()
            proc.wait()
            started = _read_available(started_r, limit_s=0.1)
            os.close(started_r)
            out.close()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if sandboxed and not started and not timed_out:
            raise _NotStarted(out.text().strip()[:500] or f"bwrap exited with {code}")
        return CommandResult(exit_code=code, output=out.text(), timed_out=timed_out,
                             truncated=out.truncated, full_output_path=out.spill_path,
                             total_bytes=out.total, duration=time.monotonic() - t0,
                             sandboxed=sandboxed)

    def _spill_dir(self) -> Path:
        if self.session_dir is not None:
            return self.session_dir / "command-output"
        return self._tmp / "command-output"


# ---------------------------------------------------------------- output

class _Output:
    """Keeps all output up to `cap` bytes; past it, the head and tail halves in memory and
    everything (up to `full_cap`) in a spill file."""

    def __init__(self, cap: int, full_cap: int, spill_dir: Path):
        self.cap, self.full_cap, self.spill_dir = max(cap, 2), full_cap, spill_dir
        self.buf = bytearray()        # everything, until truncated; then the head
        self.tail = bytearray()
        self.total = 0
        self.truncated = False
        self.spill_path: Path | None = None
        self._spill = None
        self._spilled = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        if not self.truncated:
            self.buf += data
            if len(self.buf) <= self.cap:
                return
            self.truncated = True
            self._open_spill()
            self._write_spill(bytes(self.buf))
            half = self.cap // 2
            self.tail = self.buf[-half:]
            del self.buf[half:]
            return
        self._write_spill(data)
        self.tail += data
        if len(self.tail) > 4 * self.cap:
            del self.tail[:-(self.cap // 2)]

    def _open_spill(self) -> None:
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="command-", suffix=".log", dir=self.spill_dir)
            self._spill = os.fdopen(fd, "wb")
            self.spill_path = Path(name)
        except OSError as e:
            log.warning("cannot save full command output: %s", e)

    def _write_spill(self, data: bytes) -> None:
        if self._spill is None or self._spilled >= self.full_cap:
            return
        chunk = data[: self.full_cap - self._spilled]
        self._spill.write(chunk)
        self._spilled += len(chunk)

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def text(self) -> str:
        if not self.truncated:
            return self.buf.decode("utf-8", "replace")
        half = self.cap // 2
        tail = bytes(self.tail[-half:])
        omitted = self.total - len(self.buf) - len(tail)
        if self.spill_path is None:
            where = "full output not saved"
        elif self._spilled < self.total:
            where = f"first {self._spilled:,} bytes saved to {self.spill_path}"
        else:
            where = f"full output saved to {self.spill_path}"
        notice = (f"\n[... {omitted:,} bytes omitted of {self.total:,}; {where}. "
                  "Narrow the command (grep, head, tail) to see a part ...]\n")
        return (bytes(self.buf).decode("utf-8", "replace") + notice
                + tail.decode("utf-8", "replace"))


def _pump(proc: subprocess.Popen, out: _Output, deadline: float) -> bool:
    """Read output until the shell has exited and the pipe is closed (or, when background
    children keep the pipe open, a short grace period after the exit), or the deadline.
    Returns True when the deadline passed. Never reaps the child."""
    fd = proc.stdout.fileno()
    exited_at, eof = None, False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and (eof or now - exited_at > _EXIT_GRACE_S):
                return False
            if now >= deadline:
                return True
            wait = min(deadline - now, 0.05 if eof or exited_at is not None else 0.25)
            if eof:                    # output closed early; wait for the exit itself
                time.sleep(wait)
            elif sel.select(wait):
                data = os.read(fd, 1 << 16)
                out.feed(data)
                eof = not data


def _read_available(fd: int, out: _Output | None = None, limit_s: float = 1.0) -> bytes:
    """Whatever is already in the pipe, without blocking (fed to `out` when given)."""
    os.set_blocking(fd, False)
    got, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not data:
            break
        if out is not None:
            out.feed(data)
        else:
            got += data
    return got


def _has_exited(pid: int) -> bool:
    """Whether the child exited, without reaping it (its pid keeps the group id taken)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    _quietly(os.killpg, pgid, signal.SIGKILL)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:           # already gone, not ours any more
        pass


def _count_own_processes() -> int:
    uid = os.getuid()
    try:
        return sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _owner(e) == uid)
    except OSError:
        return 4096


def _owner(entry: os.DirEntry) -> int | None:
    try:
        return entry.stat().st_uid
    except OSError:
        return None


# ---------------------------------------------------------------- pids cgroup

_cgroup_root: Path | None | bool = False     # False: not looked for yet
_cgroup_lock = threading.Lock()


def _pids_cgroup_root() -> Path | None:
    """A cgroup directory under which this process may create `pids`-limited children:
    the root of a cgroup2 hierarchy with the pids controller, or of a v1 `pids` hierarchy."""
    global _cgroup_root
    with _cgroup_lock:
        if _cgroup_root is False:
            _cgroup_root = _find_pids_cgroup_root()
            if _cgroup_root is not None:
                _sweep_stale_cgroups(_cgroup_root)
        return _cgroup_root


def _sweep_stale_cgroups(root: Path) -> None:
    """Remove the empty cgroups of runtimes that died without cleaning up (killed, crashed).
    Processes are never killed here: a cgroup's creator may live in another pid namespace."""
    for d in root.glob("apprentice-*-*"):
        pid = d.name.split("-")[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _quietly(d.rmdir)      # fails (EBUSY) while it still holds processes


def _find_pids_cgroup_root() -> Path | None:
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    fields = [line.split() for line in mounts]
    candidates = [Path(f[1]) for f in fields if len(f) > 3 and (
        f[2] == "cgroup2" or (f[2] == "cgroup" and "pids" in f[3].split(",")))]
    for root in candidates:
        probe = root / f"apprentice-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
        except OSError:
            continue
        usable = (probe / "pids.max").exists()
        _quietly(probe.rmdir)
        if usable:
            return root
    return None


def _new_pids_cgroup(max_processes: int) -> Path | None:
    root = _pids_cgroup_root()
    if root is None:
        return None
    path = root / f"apprentice-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(max_processes))
        return path
    except OSError as e:
        log.debug("cannot create pids cgroup %s: %s", path, e)
        _remove_cgroup(path)
        return None


def _remove_cgroup(path: Path | None) -> None:
    """Kill whatever is left in the cgroup (daemons, a fork bomb), then remove it."""
    if path is None or not path.exists():
        return
    kill_file = path / "cgroup.kill"
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        if not pids:
            try:
                path.rmdir()
                return
            except OSError:
                time.sleep(0.01)      # exiting tasks still charged; try again
                continue
        if kill_file.exists():
            _quietly(kill_file.write_text, "1")
        for pid in pids:
            _quietly(os.kill, pid, signal.SIGKILL)
        time.sleep(0.005)
    log.debug("cgroup %s not removed", path)
