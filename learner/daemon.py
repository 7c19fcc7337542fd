"""`apprentice daemon`: the background learner of one `$APPRENTICE_HOME`.

It holds the home's lock (`learner/daemon.lock`; a second daemon refuses to start), lowers
its own priority (`os.nice`), serves the version store to connected runtimes
(`learner.server`), and watches the session store with `watchdog`. Whenever the store changes
it derives the implicit signals of finished sessions and counts the rated samples waiting; it
runs a learning cycle (`learner.online`) when `min_samples` wait, or when anything waits and
`schedule_minutes` have passed since the last cycle. Every start settles the cycles a killed
daemon left (see "Crash safety" in `online.py`), so it survives restarts. It writes a log the
user can read, `learner/daemon.log`, one line per event, and `learner/daemon.json` (pid, url)
for `apprentice learn status` and the TUI.

Not here: what a cycle does (`online.py`), the HTTP protocol (`server.py`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_runtime.learning import (DAEMON_FILE, LOCK_FILE, learner_dir, learner_status,
                                    load_config, status_line, waiting_samples)
from learner.online import LearnerBusy, OnlineConfig, OnlineLearner

log = logging.getLogger("apprentice.daemon")
LOG_FILE = "daemon.log"


@dataclass
class DaemonConfig:
    serve: bool = True              # run a version server for connected runtimes
    host: str = "127.0.0.1"         # where the version server listens
    port: int = 8750                # its port (0: any free port, written to daemon.json)
    token: str = ""                 # its bearer token ("" = $APPRENTICE_TOKEN, else a new one)
    nice: int = 10                  # added to the process's niceness (low CPU priority)
    poll_s: float = 60.0            # wake at least this often to check the schedule
    settle_s: float = 1.0           # after a change, wait this long for writes to settle
    online: OnlineConfig = field(default_factory=OnlineConfig)   # what a cycle does


class DaemonRunning(RuntimeError):
    """Another daemon holds this home's lock."""


class Daemon:
    def __init__(self, store: Any, config: DaemonConfig | None = None):
        self.store, self.config = store, config or DaemonConfig()
        self.home = Path(store.home)
        self.dir = learner_dir(self.home)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.learner = OnlineLearner(store, self.config.online)
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.last_cycle = time.monotonic()
        self.server = None
        self._lock_file = None

    # -- life cycle ------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the home's lock or raise DaemonRunning."""
        f = open(self.dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            try:
                pid = json.loads((self.dir / DAEMON_FILE).read_text()).get("pid")
            except (OSError, ValueError):
                pid = "?"
            raise DaemonRunning(f"a daemon (pid {pid}) already runs for {self.home}") from None
        self._lock_file = f

    def run(self) -> None:
        """Run until SIGTERM / SIGINT / `stop()`."""
        self.acquire()
        _log_to(self.dir / LOG_FILE)
        try:
            os.nice(self.config.nice)
        except OSError:
            pass
        observer = None
        try:
            url = self._start_server()
            info = {"pid": os.getpid(), "url": url, "started": time.time()}
            _write_private(self.dir / DAEMON_FILE, json.dumps(info))
            log.info("daemon started (pid %d) for %s; versions %s", os.getpid(), self.home,
                     f"served at {url}" if url else "not served")
            self._settle()
            observer = self._watch()
            self.wake.set()                        # look once at startup
            while not self.stopping.is_set():
                if self.wake.wait(self.config.poll_s):
                    self.stopping.wait(self.config.settle_s)
                    self.wake.clear()
                if not self.stopping.is_set():
                    self.tick()
        finally:
            if observer is not None:
                observer.stop()
                observer.join(timeout=5)
            if self.server is not None:
                self.server.stop()
            (self.dir / DAEMON_FILE).unlink(missing_ok=True)
            log.info("daemon stopped")
            self._lock_file.close()

    def stop(self, *_: Any) -> None:
        self.stopping.set()
        self.wake.set()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    # -- one look at the store ---------------------------------------------------------------

    def due(self) -> str | None:
        """Why a cycle should run now, or None."""
        try:
            cfg = load_config(self.home)
        except ValueError as exc:
            log.error("%s; no learning until it is fixed", exc)
            return None
        if not cfg.enabled:
            return None
        waiting = waiting_samples(self.store)
        if waiting and waiting >= cfg.min_samples:
            return f"{waiting} rated samples waiting (>= {cfg.min_samples})"
        elapsed = time.monotonic() - self.last_cycle
        if waiting and cfg.schedule_minutes and elapsed >= 60 * cfg.schedule_minutes:
            return (f"{waiting} rated samples waiting, {cfg.schedule_minutes:g} min since the "
                    f"last cycle")
        return None

    def tick(self) -> None:
        """Derive signals, and run a cycle when one is due."""
        from learner.sentiment import derive_signals
        try:
            added = derive_signals(self.store, self.config.online.signals)
            if added:
                log.info("recorded %d implicit feedback signals", added)
            why = self.due()
            if why is None:
                return
            log.info("cycle: %s", why)
            result = self.learner.run_cycle()
            self.last_cycle = time.monotonic()
            shift = result.logprob_shift
            log.info("cycle %s: %s%s; %d samples (%d liked, %d disliked), logprob shift liked "
                     "%s disliked %s; %s", result.cycle_id, result.status,
                     f" v{result.version}" if result.version else "", result.samples,
                     result.liked, result.disliked, _fmt(shift.get("liked")),
                     _fmt(shift.get("disliked")), result.gate.get("reason"))
        except LearnerBusy as exc:
            log.info("%s", exc)
        except Exception as exc:               # keep serving; the cycle is recorded as failed
            log.exception("cycle failed: %s", exc)
            self.last_cycle = time.monotonic()

    # -- pieces ----------------------------------------------------------------------------

    def _settle(self) -> None:
        with self.learner._cycle_lock():
            settled = self.learner.recover()
        if settled:
            log.info("settled cycles a stopped learner left: %s", settled)

    def _start_server(self) -> str | None:
        if not self.config.serve:
            return None
        from learner.server import ServerConfig, VersionServer
        token = self.config.token or os.environ.get("APPRENTICE_TOKEN") or secrets.token_hex(16)
        self.server = VersionServer(self.learner.versions.root, ServerConfig(host=self.config.host, port=self.config.port,
                                                 token=token)).start()
        return self.server.url

    def _watch(self) -> Any:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
        wake = self.wake

        class Changed(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                if Path(str(event.src_path)).name.startswith("apprentice.db"):
                    wake.set()

        observer = Observer()
        observer.schedule(Changed(), str(self.home), recursive=False)
        observer.start()
        return observer


def status_report(store: Any) -> tuple[dict, str]:
    """(`learner_status`, one line) for `apprentice learn status`."""
    status = learner_status(store)
    return status, status_line(status)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:+.4f}"


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                           "%Y-%m-%d %H:%M:%S"))
    for name in ("apprentice.daemon", "learner"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
