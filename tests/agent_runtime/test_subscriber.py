"""Runtimes following a version server: real HTTP on 127.0.0.1, real processes, no mocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from agent_runtime import delta
from agent_runtime.subscriber import Subscriber, SubscriberConfig
from learner.server import ServerConfig, VersionServer
from learner.versions import StoreConfig, VersionStore

TOKEN = "test-token"
REPO = Path(__file__).resolve().parents[2]
FAST = SubscriberConfig(timeout_s=10, backoff_s=0.05, backoff_max_s=0.5)


def first_state() -> dict[str, torch.Tensor]:
    """A few MoE-shaped tensors of ~100k elements."""
    g = torch.Generator().manual_seed(0)
    return {"embed": (torch.randn(1000, 100, generator=g) * 0.02).to(torch.bfloat16),
            "layers.0.experts.up": (torch.randn(8, 100, 128, generator=g) * 0.02).to(torch.bfloat16),
            "layers.0.router": torch.randn(8, 100, generator=g) * 0.02,
            "norm": torch.ones(100)}


def next_state(state: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=g) < 0.03
        out[name] = (t.float() + mask * torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype)
    return out


def copy(state):
    return {k: v.clone() for k, v in state.items()}


def wait_until(predicate, timeout: float, what: str, tick=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def store(tmp_path):
    store = VersionStore(tmp_path / "store", StoreConfig(snapshot_every=4))
    store.publish(first_state())
    return store


@pytest.fixture
def server(store):
    server = VersionServer(store.root, ServerConfig(port=0, token=TOKEN, poll_s=0.02)).start()
    yield server
    server.stop()


# ----------------------------------------------------------------- in-process runtime

def test_weights_change_only_when_the_loop_swaps(store, server):
    weights = copy(first_state())
    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: sub.version == 1, 20, "the subscriber to identify v1")
        new = next_state(first_state(), 1)
        store.publish(new)
        wait_until(lambda: sub.staged == 2, 20, "v2 to be staged")
        assert delta.state_sha256(weights) == store.info(1).sha256   # generation in flight
        assert sub.version == 1 and "ready" in sub.status
        assert sub.maybe_swap() == 2
        assert delta.state_sha256(weights) == delta.state_sha256(new)
        assert sub.version == 2 and sub.maybe_swap() is None
        wait_until(lambda: "up to date" in sub.status, 5, "status to settle")


def test_poll_swap_hands_the_verified_patch_to_the_caller(store, server):
    weights = copy(first_state())
    store.publish(next_state(first_state(), 1))
    seen = []
    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: sub.staged == 2, 20, "v2 to be staged")
        assert sub.poll_swap(lambda patch: (seen.append(patch.to_version), patch.commit(weights)))
    assert seen == [2] and delta.state_sha256(weights) == store.info(2).sha256


def test_a_refused_swap_leaves_the_weights_and_is_retried(store, server):
    weights = copy(first_state())
    store.publish(next_state(first_state(), 1))

    def refuse(patch):
        raise delta.DeltaError("engine refused")

    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: sub.staged == 2, 20, "v2 to be staged")
        assert sub.poll_swap(refuse) is None and sub.version == 1
        assert delta.state_sha256(weights) == store.info(1).sha256
        wait_until(lambda: sub.version == 2, 20, "v2 after a resync", tick=sub.maybe_swap)
    assert delta.state_sha256(weights) == store.info(2).sha256


def test_a_runtime_far_behind_fetches_one_cumulative_delta(store, server):
    state = first_state()
    for i in range(5):
        state = next_state(state, i)
        store.publish(state)
    weights = copy(first_state())
    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: sub.version == 6, 20, "v6", tick=sub.maybe_swap)
    assert delta.state_sha256(weights) == delta.state_sha256(state)
    assert (store.root / "cache" / "00000001-00000006.delta").exists()


def test_unknown_weights_fall_back_to_a_snapshot(store, server):
    weights = {k: torch.zeros_like(v) for k, v in first_state().items()}
    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: sub.version == 1, 20, "v1 from a snapshot", tick=sub.maybe_swap)
    assert delta.state_sha256(weights) == store.info(1).sha256


def test_a_bad_delta_is_rejected_and_the_runtime_keeps_its_version(store, server):
    weights = copy(first_state())
    store.publish(next_state(first_state(), 1))
    path = store.delta_path(1, 2)
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))       # the server's own store cannot rebuild v2 either
    with Subscriber(weights, server.url, TOKEN, FAST) as sub:
        wait_until(lambda: "retry" in sub.status, 20, "the subscriber to report a failure")
        time.sleep(0.3)
        assert sub.maybe_swap() is None and sub.version == 1
        assert delta.state_sha256(weights) == store.info(1).sha256
        path.write_bytes(good)
        wait_until(lambda: sub.version == 2, 20, "recovery once the store is repaired",
                   tick=sub.maybe_swap)
    assert delta.state_sha256(weights) == store.info(2).sha256


def test_wrong_token_never_swaps(store, server):
    weights = copy(first_state())
    store.publish(next_state(first_state(), 1))
    with Subscriber(weights, server.url, "wrong", FAST) as sub:
        wait_until(lambda: "401" in sub.status, 20, "an authentication error")
        assert sub.maybe_swap() is None
    assert delta.state_sha256(weights) == store.info(1).sha256


# ----------------------------------------------------------------- real processes

def spawn(args: list[str]) -> subprocess.Popen:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, APPRENTICE_TOKEN=TOKEN, PYTHONPATH=path)
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class Runtime:
    """A headless runtime process following the server; `at` is its (version, sha256)."""

    def __init__(self, url: str, init: Path):
        self.url, self.init = url, init
        self.start()

    def start(self) -> None:
        self.at: tuple[int, str] | None = None
        self.proc = spawn(["-m", "agent_runtime.subscriber", "--connect", self.url,
                           "--init", str(self.init), "--interval", "0.02", "--verify",
                           "--backoff-max", "0.5"])
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            if line.startswith("at ") and not line.startswith("at None"):
                _, version, sha, _ = line.split()
                if proc is self.proc:
                    self.at = (int(version), sha)


class Processes:
    def __init__(self):
        self.all: list[subprocess.Popen] = []

    def add(self, proc):
        self.all.append(proc)
        return proc

    def kill_all(self):
        for proc in self.all:
            kill(proc)


@pytest.fixture
def procs():
    processes = Processes()
    yield processes
    processes.kill_all()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(procs: Processes, store_dir: Path, port: int) -> subprocess.Popen:
    """`learner.server.serve` in its own process, as `apprentice serve` runs it."""
    return procs.add(spawn(["-c", "import sys; from learner.server import serve; "
                            "serve(sys.argv[1], '127.0.0.1', int(sys.argv[2]), sys.argv[3])",
                            str(store_dir), str(port), TOKEN]))


def start_runtimes(procs, url, store, n=4) -> list[Runtime]:
    init = store.snapshot_path(1)
    runtimes = [Runtime(url, init) for _ in range(n)]
    for r in runtimes:
        procs.add(r.proc)
    return runtimes


def converge(runtimes: list[Runtime], store: VersionStore, version: int, timeout=60) -> None:
    expected = (version, store.info(version).sha256)
    wait_until(lambda: all(r.at == expected for r in runtimes), timeout,
               f"all runtimes at v{version}: {[r.at and r.at[0] for r in runtimes]}")


def test_four_runtime_processes_converge_after_each_of_ten_versions(store, server, procs):
    runtimes = start_runtimes(procs, server.url, store)
    state = first_state()
    for i in range(10):
        state = next_state(state, 100 + i)
        version = store.publish(state)
        converge(runtimes, store, version)
    assert len({r.at for r in runtimes}) == 1


def test_killed_runtime_and_killed_server_recover_and_converge(store, procs):
    port = free_port()
    server = start_server(procs, store.root, port)
    runtimes = start_runtimes(procs, f"http://127.0.0.1:{port}", store)   # they retry until it is up
    state = next_state(first_state(), 1)
    converge(runtimes, store, store.publish(state))

    state = next_state(state, 2)
    store.publish(state)
    kill(runtimes[0].proc)                       # a runtime dies mid-update ...
    runtimes[0].start()                          # ... and restarts from its original weights
    procs.add(runtimes[0].proc)
    converge(runtimes, store, 3)

    state = next_state(state, 3)
    store.publish(state)
    kill(server)                                 # the server dies mid-update ...
    state = next_state(state, 4)
    store.publish(state)                         # ... the learner keeps publishing ...
    start_server(procs, store.root, port)        # ... and it comes back
    converge(runtimes, store, 5)
