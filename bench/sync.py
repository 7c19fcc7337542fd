"""Sync benchmark: time from publishing a version to all runtimes having swapped to it.

A version store and server run here; N runtime processes (`python -m agent_runtime.subscriber`)
follow the server. Each new version comes from one real AdamW step (as in bench/delta.py) and
is published as bf16. Runs twice: runtimes fetching deltas, then runtimes fetching full
snapshots (the store writing a snapshot of every version, as a naive system would).

Prints per mode: publish (learner side: hash, encode, write), publish -> all swapped, and
the bytes each runtime downloads per version.

    python bench/sync.py                       # ~60M parameters, 4 runtimes, 5 versions
    python bench/sync.py --preset 0.5b --versions 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import delta as codec_bench  # noqa: E402  (bench/delta.py: the MoE shapes and AdamW steps)

from learner.server import ServerConfig, VersionServer  # noqa: E402
from learner.versions import StoreConfig, VersionStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench"


class Runtime:
    def __init__(self, url: str, init: Path, snapshots: bool):
        args = [sys.executable, "-m", "agent_runtime.subscriber", "--connect", url,
                "--init", str(init), "--interval", "0.005"] + (["--snapshots"] if snapshots else [])
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, APPRENTICE_TOKEN=TOKEN, PYTHONPATH=path)
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                     start_new_session=True)
        self.at: dict[int, float] = {}                # version -> time it was swapped in
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            _, version, _, when = line.split()
            if version != "None":
                self.at[int(version)] = float(when)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_all(runtimes: list[Runtime], version: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while not all(version in r.at for r in runtimes):
        if time.monotonic() > deadline:
            raise TimeoutError(f"runtimes did not reach v{version}")
        time.sleep(0.002)
    return max(r.at[version] for r in runtimes)


def run(mode: str, params: dict, n_runtimes: int, versions: int, lr: float) -> dict:
    snapshots = mode == "snapshot"
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = VersionStore(tmp, StoreConfig(snapshot_every=1 if snapshots else 10))
        publish = lambda: store.publish(  # noqa: E731
            {k: p.detach().to(torch.bfloat16) for k, p in params.items()})
        first = publish()
        server = VersionServer(store, ServerConfig(port=0, token=TOKEN, poll_s=0.005)).start()
        runtimes = [Runtime(server.url, store.snapshot_path(first), snapshots)
                    for _ in range(n_runtimes)]
        try:
            wait_all(runtimes, first)
            publish_s, sync_s, sizes = [], [], []
            for _ in range(versions):
                opt.zero_grad()
                sum((p * torch.randn(p.shape, generator=g)).sum() for p in params.values()).backward()
                opt.step()
                t0 = time.time()
                version = publish()
                t1 = time.time()
                done = wait_all(runtimes, version)
                publish_s.append(t1 - t0)
                sync_s.append(done - t1)
                info = store.info(version)
                sizes.append(store.snapshot_path(version).stat().st_size if snapshots
                             else info.delta_bytes)
        finally:
            for r in runtimes:
                r.stop()
            server.stop()
    return {"mode": mode, "publish s": f"{statistics.median(publish_s):.2f}",
            "download MB": f"{statistics.median(sizes) / 1e6:.1f}",
            "publish->all swapped s": f"{statistics.median(sync_s):.2f}",
            "total s": f"{statistics.median(p + s for p, s in zip(publish_s, sync_s)):.2f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=codec_bench.PRESETS, default="tiny")
    parser.add_argument("--runtimes", type=int, default=4)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    params = codec_bench.moe_parameters(codec_bench.PRESETS[args.preset])
    n = sum(p.numel() for p in params.values())
    print(f"# {n / 1e6:.0f}M parameters (bf16 {2 * n / 1e6:.0f} MB), {args.runtimes} runtimes, "
          f"{args.versions} versions at AdamW lr={args.lr:g}, {os.cpu_count()} cores; medians",
          flush=True)
    rows = [run(mode, params, args.runtimes, args.versions, args.lr)
            for mode in ("delta", "snapshot")]
    codec_bench.print_table(rows)


if __name__ == "__main__":
    main()
