"""Acceptance 4: SIGKILL the daemon (a real process) mid-update, while training and while
publishing; after a restart no sample is consumed by two cycles, no half-published version
exists, and the store is consistent."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import VALID, record_session, wait_for  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner.online import HOLD_ENV  # noqa: E402
from learner.versions import VersionStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def start_daemon(home: Path, ckpt: Path, hold: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "APPRENTICE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(HOLD_ENV, None)
    if hold:
        env[HOLD_ENV] = hold
    return subprocess.Popen([sys.executable, "-m", "agent_runtime.cli", "daemon", "--model",
                             str(ckpt), "--gate-tasks", "0", "--no-serve", "--lr", "1e-3"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def cycles(home: Path) -> list[tuple]:
    with sqlite3.connect(home / "apprentice.db") as db:
        return db.execute("SELECT id, status, version FROM learner_cycles ORDER BY id").fetchall()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module", params=["training", "publishing"])
def killed_and_restarted(request, ckpt, tmp_path_factory):
    """A home whose daemon was killed at `phase` of its first cycle, then ran again until
    that cycle's samples were settled."""
    phase = request.param
    home = tmp_path_factory.mktemp(f"home-{phase}")
    (home / "config.toml").write_text("[learning]\nmin_samples = 1\n")
    policy = load_policy(str(ckpt), dtype="bfloat16")
    with SessionStore(home) as store:
        rated = []
        for i in range(3):
            sid = record_session(store, policy, f"task {i}", VALID)
            store.add_feedback(1 if i % 2 == 0 else -1, session_id=sid)
            rated += [s["id"] for s in store.samples(sid)]
    daemon = start_daemon(home, ckpt, hold=phase)
    try:
        wait_for(lambda: (home / "learner" / f"held-{phase}").exists() or daemon.poll() is not None)
        assert daemon.poll() is None, daemon.stderr.read().decode()
        before = cycles(home)
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
    daemon = start_daemon(home, ckpt)
    try:
        wait_for(lambda: any(status == "published" for _, status, _ in cycles(home))
                 or daemon.poll() is not None)
        assert daemon.poll() is None, daemon.stderr.read().decode()
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)
    return {"phase": phase, "home": home, "rated": rated, "before": before}


def test_the_kill_left_a_cycle_mid_update(killed_and_restarted):
    k = killed_and_restarted
    assert [status for _, status, _ in k["before"]] == \
        ["running" if k["phase"] == "training" else "publishing"]


def test_every_rated_sample_is_consumed_by_exactly_one_published_cycle(killed_and_restarted):
    home = killed_and_restarted["home"]
    with sqlite3.connect(home / "apprentice.db") as db:
        rows = db.execute("SELECT t.sample_id, c.status FROM trained_samples t JOIN "
                          "learner_cycles c ON c.id = t.cycle_id").fetchall()
    assert sorted(i for i, _ in rows) == sorted(killed_and_restarted["rated"])
    assert {status for _, status in rows} == {"published"}


def test_the_samples_made_one_version(killed_and_restarted):
    home = killed_and_restarted["home"]
    assert [(s, v) for _, s, v in cycles(home) if s == "published"] == [("published", 2)]
    assert VersionStore(home / "versions").latest().version == 2


def test_no_half_published_version_remains(killed_and_restarted):
    vs = VersionStore(killed_and_restarted["home"] / "versions")
    for v in (1, 2):
        vs.state(v)                                   # verified against its hash
    leftovers = [p.name for sub in ("versions", "deltas", "snapshots")
                 for p in (vs.root / sub).iterdir()
                 if p.name.startswith(".") or "00000003" in p.name]
    assert leftovers == []


def test_the_store_is_consistent(killed_and_restarted):
    with sqlite3.connect(killed_and_restarted["home"] / "apprentice.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        assert db.execute("SELECT COUNT(*) FROM learner_cycles WHERE status IN "
                          "('running', 'publishing')").fetchone()[0] == 0


def test_files_of_a_publish_cut_short_are_discarded(tmp_path):
    import torch
    vs = VersionStore(tmp_path / "versions")
    vs.publish({"w": torch.zeros(4)})
    (vs.root / "versions" / "00000002.json").write_text(json.dumps({"version": 2}))
    (vs.root / "deltas" / ".00000001-00000002.delta.123.tmp").write_bytes(b"x")
    gone = {p.name for p in vs.discard_unpublished()}
    assert gone == {"00000002.json", ".00000001-00000002.delta.123.tmp"}
