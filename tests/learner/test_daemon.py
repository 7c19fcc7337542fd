"""`apprentice daemon` as a real process: a rating made while it runs wakes it (watchdog on
the store), its cycle publishes a version it serves over HTTP, and `learn status` says on."""

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import VALID, record_session, wait_for  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def latest(url: str) -> int | None:
    request = urllib.request.Request(url + "/latest", headers={"Authorization": "Bearer t"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read())["version"]
    except OSError:
        return None


@pytest.fixture
def daemon(home, tmp_path):
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    home.mkdir(parents=True)
    (home / "config.toml").write_text("[learning]\nmin_samples = 1\n")
    with SessionStore(home) as store:                   # migrated before the daemon starts
        sid = record_session(store, load_policy(str(ckpt), dtype="bfloat16"), "fix it", VALID)
    env = {**os.environ, "APPRENTICE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "agent_runtime.cli", "daemon", "--model",
                             str(ckpt), "--gate-tasks", "0", "--port", "0", "--token", "t",
                             "--lr", "1e-3", "--poll-seconds", "3600"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    info = home / "learner" / "daemon.json"
    wait_for(lambda: info.exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.stderr.read().decode()
    yield sid, json.loads(info.read_text())["url"]
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def test_a_rating_wakes_the_daemon_and_its_version_is_served(daemon, home):
    sid, url = daemon
    assert CliRunner().invoke(main, ["feedback", sid, "up"]).exit_code == 0
    wait_for(lambda: latest(url) == 2)
    # the daemon logs the cycle after the version store announces it: wait for the line too
    wait_for(lambda: "cycle 1: published v2" in (home / "learner" / "daemon.log").read_text())


def test_learn_status_says_on_while_it_runs(daemon):
    assert CliRunner().invoke(main, ["learn", "status"]).output.startswith("learner on")
