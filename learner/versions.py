"""The version store: every published policy version on disk, under one folder.

Layout (all writes atomic: temporary file, then rename; `latest.json` last, so a reader that
sees version V finds everything V needs):

    latest.json                         {"version": V, "sha256": ...}
    versions/00000007.json              metadata of version 7 (sha256, parent, snapshot...)
    snapshots/00000001.safetensors      full state, at least every `snapshot_every` versions
    deltas/00000006-00000007.delta      consecutive deltas (agent_runtime.delta)
    cache/                              cumulative deltas and snapshots built on request

Versions are integers from 1, one per distinct state; the state's `delta.state_sha256` is
its identity. A cumulative delta A -> B is encoded directly from the two stored states
(materialized from the nearest snapshot plus at most `snapshot_every - 1` deltas), so a
runtime many versions behind downloads one file.

Not here: HTTP (learner.server), training, or pruning old versions.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from agent_runtime import delta

State = dict[str, torch.Tensor]


class VersionNotFound(LookupError):
    """The store has no such version (or cannot build what was asked of it)."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    sha256: str                    # delta.state_sha256 of the state
    parent: int | None             # the version its delta starts from
    snapshot: bool                 # a full snapshot is stored for it
    created: float                 # unix time of publishing
    nbytes: int                    # raw bytes of the full state
    delta_bytes: int | None        # size of the delta from `parent`

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StoreConfig:
    snapshot_every: int = 10       # store a full snapshot at least every N versions
    cache_files: int = 16          # cumulative deltas / snapshots kept in cache/
    cache_states: int = 2          # materialized states kept in memory


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_atomic(state: Mapping[str, torch.Tensor], path: Path, metadata: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    save_file(dict(state), tmp, metadata=metadata)
    os.replace(tmp, path)


class VersionStore:
    """Publish states as numbered versions; serve deltas and snapshots between any two."""

    def __init__(self, root: str | os.PathLike, config: StoreConfig | None = None):
        self.root = Path(root)
        self.config = config or StoreConfig()
        for sub in ("versions", "snapshots", "deltas", "cache"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._states: OrderedDict[int, tuple[State, delta.Digests]] = OrderedDict()
        self._by_sha: dict[str, int] = {}

    # ------------------------------------------------------------------ reading

    def latest(self) -> VersionInfo | None:
        """The newest version, read from disk (another process may be publishing)."""
        try:
            latest = json.loads((self.root / "latest.json").read_text())
        except FileNotFoundError:
            return None
        return self.info(latest["version"])

    def info(self, version: int) -> VersionInfo:
        try:
            return VersionInfo(**json.loads(self._path("versions", version, ".json").read_text()))
        except FileNotFoundError:
            raise VersionNotFound(f"no version {version} in {self.root}") from None

    def find(self, sha256: str) -> int | None:
        """The version whose state has this sha256, if any."""
        if sha256 not in self._by_sha:
            for path in sorted((self.root / "versions").glob("*.json")):
                info = json.loads(path.read_text())
                self._by_sha[info["sha256"]] = info["version"]
        return self._by_sha.get(sha256)

    def state(self, version: int) -> State:
        """The full state of `version` (verified); treat the tensors as read-only."""
        return self._state(version)[0]

    def mean(self, versions: Sequence[int]) -> State:
        """The element-wise mean of these versions' states, in fp32: the weights of a run
        averaged along its trajectory (stochastic weight averaging, Izmailov et al. 2018; the
        averaging step of WARP, Rame et al. 2024), one version materialized at a time."""
        from learner.merge import mean_state
        if not versions:
            raise ValueError("mean of no versions")
        return mean_state((f"version {v}", self.state(v)) for v in versions)

    def delta_path(self, from_version: int, to_version: int) -> Path:
        """A file holding the delta from one version to a later one (built on first use)."""
        if from_version > to_version:
            raise VersionNotFound(f"cannot go back from {from_version} to {to_version}")
        self.info(from_version), self.info(to_version)
        if to_version == from_version + 1:
            return self._path("deltas", from_version, f"-{to_version:08d}.delta")
        path = self._path("cache", from_version, f"-{to_version:08d}.delta")
        with self._lock:
            if not path.exists():
                old, old_d = self._state(from_version)
                new, new_d = self._state(to_version)
                _write_atomic(path, delta.encode(old, new, from_version=from_version,
                                                 to_version=to_version, old_digests=old_d,
                                                 new_digests=new_d))
                self._prune_cache()
        return path

    def delta(self, from_version: int, to_version: int) -> bytes:
        with self._lock:
            return self.delta_path(from_version, to_version).read_bytes()

    def snapshot_path(self, version: int) -> Path:
        """A safetensors file of `version` (stored, or built into cache/ on first use)."""
        info = self.info(version)
        if info.snapshot:
            return self._path("snapshots", version, ".safetensors")
        path = self._path("cache", version, ".safetensors")
        with self._lock:
            if not path.exists():
                _save_atomic(self.state(version), path, self._snapshot_meta(info))
                self._prune_cache()
        return path

    def open_snapshot(self, version: int):
        """An open binary file of `version`'s snapshot (safe against cache pruning)."""
        with self._lock:
            return open(self.snapshot_path(version), "rb")

    # ------------------------------------------------------------------ publishing

    def publish(self, state: Mapping[str, torch.Tensor]) -> int:
        """Store `state` (the tensors runtimes serve, e.g. bf16) as the next version.

        Publishing the same state as the latest version returns that version unchanged.
        """
        state = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}
        digests = delta.tensor_digests(state)
        sha = delta.state_sha256(state, digests)
        with self._lock, open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            latest = self.latest()
            if latest is not None and latest.sha256 == sha:
                return latest.version
            version = 1 if latest is None else latest.version + 1
            delta_bytes = None
            if latest is not None:
                old, old_d = self._state(latest.version)
                blob = delta.encode(old, state, from_version=latest.version, to_version=version,
                                    old_digests=old_d, new_digests=digests)
                _write_atomic(self._path("deltas", latest.version, f"-{version:08d}.delta"), blob)
                delta_bytes = len(blob)
            info = VersionInfo(
                version=version, sha256=sha, parent=None if latest is None else latest.version,
                snapshot=self._needs_snapshot(version), created=time.time(),
                nbytes=sum(t.numel() * t.element_size() for t in state.values()),
                delta_bytes=delta_bytes)
            if info.snapshot:
                _save_atomic(state, self._path("snapshots", version, ".safetensors"),
                             self._snapshot_meta(info))
            _write_atomic(self._path("versions", version, ".json"),
                          json.dumps(info.to_json(), indent=1).encode())
            _write_atomic(self.root / "latest.json",
                          json.dumps({"version": version, "sha256": sha}).encode())
            self._remember(version, state, digests)
            self._by_sha[sha] = version
            return version

    def discard_unpublished(self) -> list[Path]:
        """Remove what a publisher killed mid-way left behind: temporary files, and any
        version files beyond `latest.json` (never announced, so nobody has them). Call with
        no other publisher running; returns the files removed."""
        latest = self.latest()
        top = 0 if latest is None else latest.version
        gone = []
        with self._lock, open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for sub in ("versions", "snapshots", "deltas", "cache"):
                for path in (self.root / sub).iterdir():
                    stem = path.name.split(".")[0].split("-")[-1]
                    if path.name.startswith(".") or (stem.isdigit() and int(stem) > top):
                        path.unlink(missing_ok=True)
                        gone.append(path)
            self._by_sha.clear()
        return gone

    # ------------------------------------------------------------------ internals

    def _path(self, sub: str, version: int, suffix: str) -> Path:
        return self.root / sub / f"{version:08d}{suffix}"

    def _needs_snapshot(self, version: int) -> bool:
        recent = range(max(1, version - self.config.snapshot_every + 1), version)
        return not any(self.info(v).snapshot for v in recent)

    @staticmethod
    def _snapshot_meta(info: VersionInfo) -> dict:
        return {"version": str(info.version), "sha256": info.sha256}

    def _remember(self, version: int, state: State, digests: delta.Digests) -> None:
        self._states[version] = (state, digests)
        self._states.move_to_end(version)
        while len(self._states) > self.config.cache_states:
            self._states.popitem(last=False)

    def _state(self, version: int) -> tuple[State, delta.Digests]:
        with self._lock:
            if version in self._states:
                self._states.move_to_end(version)
                return self._states[version]
            info = self.info(version)
            chain = [info]
            while not chain[-1].snapshot and chain[-1].version not in self._states:
                if chain[-1].parent is None:
                    raise VersionNotFound(f"version {version} has no snapshot to start from")
                chain.append(self.info(chain[-1].parent))
            start = chain.pop()
            if start.version in self._states:
                state, digests = self._states[start.version]
            else:
                state = load_file(self._path("snapshots", start.version, ".safetensors"))
                digests = delta.tensor_digests(state)
                if delta.state_sha256(state, digests) != start.sha256:
                    raise delta.DeltaError(f"snapshot of version {start.version} is corrupted")
            for step in reversed(chain):
                blob = self.delta_path(step.parent, step.version).read_bytes()
                patch = delta.prepare(state, blob, digests=digests)
                if patch.sha256 != step.sha256:
                    raise delta.DeltaError(f"delta to version {step.version} has the wrong target")
                state, digests = patch.materialize(state), patch.digests
            self._remember(version, state, digests)
            return state, digests

    def _prune_cache(self) -> None:
        files = []
        for path in (self.root / "cache").glob("0*"):
            try:
                files.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                pass
        for _, path in sorted(files)[:-self.config.cache_files]:
            path.unlink(missing_ok=True)
