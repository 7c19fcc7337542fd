"""Follow a version server: fetch, verify and stage new policy versions; swap between calls.

A background thread listens to the server's `/events` stream. For each new version it
downloads one delta from the version the runtime holds (however far behind), verifies it
completely against the live weights (`delta.prepare`: base hash, section checksums, tensor
digests, resulting state hash) and stages it. Weights change only when the agent loop calls
`maybe_swap()`, `poll_swap(apply_fn)` or `apply_staged(policy)` (what `follow()`'s
`FollowingPolicy` calls) between model calls, so a generation in flight finishes on the
weights it started with. Failures are retried with exponential backoff; an
unknown base or repeated bad deltas fall back to a full snapshot.

Not here: publishing and serving versions (learner), recording the version on samples (the
loop reads `.version` after each swap).

`python -m agent_runtime.subscriber --connect URL --init STATE.safetensors` runs a headless
follower that prints `at VERSION SHA256 TIME` whenever its version changes (tests and
bench/sync.py use it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from agent_runtime import delta
from agent_runtime.policies.base import has_weights
from agent_runtime.policies.following import FollowingPolicy

log = logging.getLogger(__name__)


@dataclass
class SubscriberConfig:
    timeout_s: float = 30.0        # socket timeout; must exceed the server's heartbeat
    backoff_s: float = 0.2         # first retry delay, doubled per failure ...
    backoff_max_s: float = 10.0    # ... up to this
    snapshot_after: int = 2        # failed deltas in a row before fetching a full snapshot


class ServerError(OSError):
    """The version server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Subscriber:
    """Keeps `target` (a model or a dict of tensors) on the server's newest version."""

    def __init__(self, target: Any, url: str, token: str, config: SubscriberConfig | None = None):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"version server URL must be http://HOST:PORT, got {url!r}")
        self.target, self.url, self.config = target, url, config or SubscriberConfig()
        self._host, self._port = parts.hostname, parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.version: int | None = None          # version the weights hold (None: unknown)
        self.sha256: str | None = None           # state hash of the weights
        self.latest: int | None = None           # newest version the server announced
        self.status = f"connecting to {url}"
        self._digests: delta.Digests | None = None
        self._staged: delta.Patch | None = None
        self._weights = threading.Lock()         # held while reading or writing the weights
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()   # sockets stop() must interrupt
        self._thread = threading.Thread(target=self._run, daemon=True, name="subscriber")
        self._failures = 0
        self._identified = False

    # ------------------------------------------------------------------ agent loop side

    def start(self) -> "Subscriber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._interrupt()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Subscriber":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def staged(self) -> int | None:
        patch = self._staged
        return None if patch is None else patch.to_version

    def maybe_swap(self) -> int | None:
        """Commit a staged version into `target`; returns the new version, or None."""
        return self.poll_swap(lambda patch: patch.commit(self.target))

    def poll_swap(self, apply_fn: Callable[[delta.Patch], None]) -> int | None:
        """If a verified version is staged, hand it to `apply_fn` (which must commit it).

        Never blocks: if the background thread is reading the weights, the swap waits for
        the next call. Returns the new version, or None when nothing was swapped.
        """
        if self._staged is None or not self._weights.acquire(blocking=False):
            return None
        try:
            patch, self._staged = self._staged, None
            if patch is None:
                return None
            try:
                apply_fn(patch)
            except Exception as e:
                self.status = f"{self._v()} · swap to v{patch.to_version} failed: {e}"
                log.error("swap to v%s failed: %s", patch.to_version, e)
                self._resync()
                if isinstance(e, delta.DeltaError):       # refused before any write
                    return None
                raise
            self.version, self.sha256, self._digests = patch.to_version, patch.sha256, patch.digests
            self._set_status()
            return self.version
        finally:
            self._weights.release()

    def apply_staged(self, policy: Any,
                     on_swap: Callable[[int, str | None], None] | None = None) -> int | None:
        """Apply the staged version, if any, to `policy` (an engine policy on this
        subscriber's model) between its model calls: what a `FollowingPolicy` calls before
        each one. Returns the new version, or None; `on_swap(version, sha256)` after a swap.
        When nothing is staged but the server recognised our weights as another version,
        the policy takes on that version number."""
        def apply(patch: delta.Patch) -> None:
            policy.swap_state(lambda _state: patch.commit(policy.model), patch.to_version)

        version = self.poll_swap(apply)
        if version is None:
            known = self.version                        # the server recognised our weights
            if known is not None and known != policy.version:
                policy.version = known
            return None
        if on_swap is not None:
            on_swap(version, self.sha256)
        return version

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        delay = self.config.backoff_s
        while not self._stop.is_set():
            try:
                if not self._identified:
                    self._identify()
                with contextlib.closing(self._events()) as events:
                    for event in events:
                        self.latest = event["version"]
                        self._catch_up(event["version"], event["sha256"])
                        delay = self.config.backoff_s
            except Exception as e:                       # never let the thread die
                if self._stop.is_set():
                    break
                self.status = f"{self._v()} · {e or type(e).__name__}; retry in {delay:.1f}s"
                expected = (OSError, ValueError, http.client.HTTPException)
                log.warning("subscriber: %s", self.status, exc_info=not isinstance(e, expected))
                self._stop.wait(delay)
                delay = min(delay * 2, self.config.backoff_max_s)

    def _identify(self) -> None:
        """Hash the weights once and ask the server which version they are."""
        if self._digests is None:
            with self._weights:
                digests = delta.tensor_digests(self.target)
                self.sha256 = delta.state_sha256(self.target, digests)
                self._digests = digests
        try:
            self.version = json.loads(self._get(f"/find?sha256={self.sha256}"))["version"]
        except ServerError as e:
            if e.status != 404:
                raise
            self.version = None                  # not a published version: needs a snapshot
        self._identified = True
        self._set_status()

    def _catch_up(self, version: int, sha: str) -> None:
        """Download, verify and stage `version` unless the weights or the stage hold it."""
        while not self._stop.is_set():
            staged = self._staged
            if sha in (self.sha256, staged and staged.sha256):
                return self._set_status()
            base = self.version
            use_delta = (base is not None and base < version
                         and self._failures < self.config.snapshot_after)
            self.status = f"{self._v()} · fetching v{version}" + ("" if use_delta else " snapshot")
            try:
                data = self._get(f"/delta?from={base}&to={version}" if use_delta
                                 else f"/snapshot/{version}")
            except ServerError as e:
                if not use_delta or e.status not in (404, 410):
                    raise
                self._failures = self.config.snapshot_after         # chain broken
                continue
            try:
                patch = None if use_delta else self._replacement(data, version, sha)
                with self._weights:
                    if self.version != base:       # swapped meanwhile: start over from there
                        continue
                    if use_delta:
                        patch = delta.prepare(self.target, data, digests=self._digests)
                    if patch.sha256 != sha or patch.to_version != version:
                        raise delta.DeltaError(f"server sent v{patch.to_version} "
                                               f"{patch.sha256[:12]} for v{version} {sha[:12]}")
                    self._staged = patch           # staged under the lock: base is current
            except delta.DeltaError:
                self._failures += 1
                raise
            self._failures = 0
            return self._set_status()

    @staticmethod
    def _replacement(data: bytes, version: int, sha: str) -> delta.Patch:
        from safetensors.torch import load

        try:
            state = load(data)
        except Exception as e:                     # safetensors raises its own error type
            raise delta.DeltaError(f"snapshot v{version} unreadable: {e}") from None
        return delta.Patch.replacement(state, sha256=sha, to_version=version)

    def _resync(self) -> None:
        """Forget what we know about the weights; rehash them and catch up from scratch."""
        self._staged, self._digests, self._identified = None, None, False
        self._interrupt()

    def _interrupt(self) -> None:
        for sock in list(self._open):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ HTTP

    @contextlib.contextmanager
    def _request(self, path: str) -> Iterator[http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.config.timeout_s)
        try:
            conn.connect()
            sock = conn.sock
            self._open.add(sock)
            try:
                if self._stop.is_set():
                    raise ConnectionError("subscriber stopped")
                conn.request("GET", self._prefix + path, headers=self._headers)
                response = conn.getresponse()
                if response.status != 200:
                    raise ServerError(response.status, _error_message(response.read()))
                yield response
            finally:
                self._open.discard(sock)
        finally:
            conn.close()

    def _get(self, path: str) -> bytes:
        with self._request(path) as response:
            return response.read()    # raises IncompleteRead if the server dies mid-body

    def _events(self) -> Iterator[dict]:
        """Parsed `version` events of the server-sent event stream, until it ends."""
        with self._request("/events") as response:
            event, data = None, []
            while not self._stop.is_set():
                line = response.readline()
                if not line:
                    raise ConnectionError("event stream closed")
                line = line.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line:
                    if event == "version" and data:
                        yield json.loads("\n".join(data))
                    event, data = None, []

    # ------------------------------------------------------------------ display

    def _v(self) -> str:
        return "v?" if self.version is None else f"v{self.version}"

    def _set_status(self) -> None:
        if self.staged is not None:
            self.status = f"{self._v()} · v{self.staged} ready, swaps at the next model call"
        elif self.latest is not None and self.sha256 is not None and self.version == self.latest:
            self.status = f"{self._v()} · up to date"
        else:
            self.status = f"{self._v()} · server at v{self.latest}"


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def follow(policy: Any, url: str, token: str, store: Any = None) -> tuple[Any, "Subscriber | None"]:
    """(policy, subscriber): follow the version server at `url` when the policy has weights
    to swap (an engine policy; a replay script has none: returned as is, subscriber None).
    Each applied version is recorded in `store` when one is given."""
    if not has_weights(policy):
        return policy, None
    subscriber = Subscriber(policy.model, url, token).start()

    def record(version: int, sha256: str | None) -> None:
        if store is not None and sha256:
            store.record_policy_version(version, sha256, source=url)

    return FollowingPolicy(policy, lambda p: subscriber.apply_staged(p, on_swap=record)), subscriber


def main(argv: list[str] | None = None) -> None:
    """Headless follower: load a state, follow a server, print `at VERSION SHA256 TIME`."""
    import argparse

    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--connect", required=True, help="version server URL")
    parser.add_argument("--token", default=os.environ.get("APPRENTICE_TOKEN", ""),
                        help="bearer token (default: $APPRENTICE_TOKEN)")
    parser.add_argument("--init", required=True, help="starting state (.safetensors)")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between swaps")
    parser.add_argument("--verify", action="store_true", help="rehash the weights after a swap")
    parser.add_argument("--backoff-max", type=float, default=SubscriberConfig.backoff_max_s,
                        help="longest wait between retries, seconds")
    parser.add_argument("--snapshots", action="store_true",
                        help="always fetch full snapshots, never deltas (benchmarks)")
    args = parser.parse_args(argv)
    state = load_file(args.init)
    config = SubscriberConfig(backoff_max_s=args.backoff_max)
    if args.snapshots:
        config.snapshot_after = 0
    sub = Subscriber(state, args.connect, args.token, config).start()
    shown = None
    while True:
        sub.maybe_swap()
        if sub.version != shown:
            shown = sub.version
            sha = delta.state_sha256(state) if args.verify else sub.sha256
            print(f"at {shown} {sha} {time.time():.6f}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
