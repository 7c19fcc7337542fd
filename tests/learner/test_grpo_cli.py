"""`apprentice learn grpo` / `learn report`: a toy run, resume after SIGKILL without losing
published versions, and the PNG report."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from learner.report import load_metrics  # noqa: E402
from learner.versions import VersionStore  # noqa: E402

FAST = ["--tasks", "toy", "--group", "4", "--groups-per-step", "1", "--max-new-tokens", "4",
        "--lr", "1e-2", "--threads", "1"]


@pytest.fixture(autouse=True)
def restore_threads():
    import torch
    old = torch.get_num_threads()                  # --threads sets it for the process
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_commands_have_help():
    for cmd in (["learn", "grpo"], ["learn", "report"]):
        out = invoke(*cmd, "--help")
        assert "Usage" in out and len(out.splitlines()) > 3


def test_grpo_options_default_to_the_config_dataclasses():
    from learner.cli import grpo
    from learner.config import RunConfig
    c = RunConfig()
    expected = {"group": c.rollout.group_size, "steps": c.pipeline.steps,
                "groups_per_step": c.pipeline.groups_per_step, "lr": c.trainer.optim.lr,
                "max_staleness": c.pipeline.max_staleness,
                "max_new_tokens": c.rollout.max_new_tokens, "max_steps": c.rollout.max_steps,
                "checkpoint_every": c.trainer.checkpoint_every,
                "temperature": c.trainer.temperature, "seed": c.pipeline.seed,
                "threads": c.pipeline.torch_threads, "model": c.model, "family": c.tasks}
    defaults = {p.name: p.default for p in grpo.params}
    assert {k: defaults[k] for k in expected} == expected


def test_grpo_runs_resumes_and_reports(ckpt, home, tmp_path):
    out = invoke("learn", "grpo", "--model", ckpt, "--steps", 2, "--sync", *FAST)
    assert "started" in out and "step 2, version 3" in out
    out = invoke("learn", "grpo", "--model", ckpt, "--steps", 3, "--no-replay", *FAST)
    assert "resumed" in out and "at step 2" in out and "step 3, version 4" in out
    run = home / "runs" / "grpo"
    rows = load_metrics(run)
    assert [(r["step"], r["mode"], r["replay"]) for r in rows] == \
        [(1, "sync", 1), (2, "sync", 1), (3, "async", 0)]
    out = invoke("learn", "report", "-o", tmp_path / "curves.png")
    assert "3 steps" in out
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_metrics_is_an_error(home):
    result = CliRunner().invoke(main, ["learn", "report"])
    assert result.exit_code != 0 and "no metrics" in result.output


def wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_killed_run_resumes_from_its_last_checkpoint_keeping_versions(ckpt, tmp_path):
    env = {**os.environ, "APPRENTICE_HOME": str(tmp_path / "home")}
    run, store = tmp_path / "run", tmp_path / "versions"
    cmd = [sys.executable, "-m", "agent_runtime.cli", "learn", "grpo", "--model", str(ckpt),
           "--run", str(run), "--versions", str(store), *FAST]
    proc = subprocess.Popen(cmd + ["--steps", "1000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_for(lambda: len(list((run / "checkpoints").glob("step-*.pt"))) >= 2
                        or proc.poll() is not None), "no checkpoints appeared"
        assert proc.poll() is None, proc.stderr.read().decode()
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    versions = VersionStore(store)
    before = {v: versions.info(v).sha256 for v in range(1, versions.latest().version + 1)}
    checkpoint = max(int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("step-*.pt"))
    target = checkpoint + 2
    done = subprocess.run(cmd + ["--steps", str(target)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resumed {run} at step {checkpoint}" in done.stdout
    assert f"step {target}," in done.stdout
    after = VersionStore(store)
    assert all(after.info(v).sha256 == sha for v, sha in before.items())   # none lost or changed
    assert max(before) < after.latest().version <= max(before) + 2
    assert [r["step"] for r in load_metrics(run)][:target] == list(range(1, target + 1))


def test_a_number_a_step_did_not_measure_shows_as_a_dash_not_nan():
    from learner.cli import _progress_line
    line = _progress_line({"version": 3, "reward_mean": 0.5, "pass_rate": None,
                           "kl": float("nan"), "flip_rate": 0.0})
    assert line == "v3 reward 0.500 pass - kl - flip 0.000"
