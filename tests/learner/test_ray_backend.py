"""The Ray backend of the pipeline (`learner.ray_backend`) on a local Ray instance started
here: it trains and publishes, survives a killed rollout actor without training a group twice,
and every actor holds bit-identical weights (sha256) to each published version. Skipped when
ray is not installed (`pip install -e '.[dev,ray]'`), except under CI (`CI=true`), where it
must run."""

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner import pipeline  # noqa: E402
from learner.config import (OptimConfig, PipelineConfig, RayConfig, RolloutConfig,  # noqa: E402
                            RunConfig, TrainerConfig)
from learner.versions import VersionStore  # noqa: E402

pipeline_build = pipeline.build

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ray_cluster():
    try:
        import ray
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("ray is not installed; CI must run the Ray backend tests "
                        "(pip install -e '.[dev,ray]')")
        pytest.skip("ray is not installed (pip install -e '.[dev,ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


def build(ckpt, tmp_path, steps):
    config = RunConfig(model=str(ckpt), tasks="toy",
                       trainer=TrainerConfig(optim=OptimConfig(lr=1e-2), checkpoint_every=0),
                       rollout=RolloutConfig(group_size=4, max_new_tokens=6, backend="ray",
                                             workers=2),
                       pipeline=PipelineConfig(steps=steps, groups_per_step=2),
                       ray=RayConfig(num_cpus=1))
    store = SessionStore(tmp_path / "home")
    versions = VersionStore(tmp_path / "versions")
    return pipeline.build(config, tmp_path / "run", store, versions), store, versions


@pytest.fixture(scope="module")
def run(ray_cluster, ckpt, tmp_path_factory):
    """One 4-step `apprentice learn grpo --backend ray --tasks toy` on two actors; the
    pipeline it built is kept for the tests that look at its results."""
    tmp = tmp_path_factory.mktemp("run")
    built, before = [], {}

    def keep(*args, **kw):
        built.append(pipeline_build(*args, **kw))
        before.update({k: v.clone() for k, v in built[0].trainer.model.state_dict().items()})
        return built[0]
    threads = torch.get_num_threads()             # --threads sets it for the process
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPRENTICE_HOME", str(tmp / "home"))
        mp.setattr(pipeline, "build", keep)
        result = CliRunner().invoke(main, [
            "learn", "grpo", "--backend", "ray", "--workers", "2", "--tasks", "toy",
            "--model", str(ckpt), "--steps", "4", "--group", "4", "--groups-per-step", "2",
            "--max-new-tokens", "6", "--lr", "1e-2", "--threads", "1",
            "--checkpoint-every", "100", "--run", str(tmp / "run"),
            "--versions", str(tmp / "versions")], catch_exceptions=False)
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "(async, ray, replay on)" in result.output
    pipe = built[0]
    with SessionStore(tmp / "home") as store:
        samples = [s for row in store.list_sessions(1000, include_all=True)
                   for s in store.samples(row["id"])]
    return pipe, samples, VersionStore(tmp / "versions"), before, pipe.trainer.metrics()


def trained_sessions(pipe):
    """Record the session ids of every group the trainer trains on."""
    seen, train = [], pipe._train

    def recording(groups, idle_s):
        seen.extend(e.session_id for g in groups for e in g.episodes)
        return train(groups, idle_s)
    pipe._train = recording
    return seen


def test_learn_grpo_on_ray_trains_and_publishes_versions(run):
    pipe, _, versions, before, rows = run
    assert pipe.trainer.step_count == 4 and pipe.stats.episodes_trained == 4 * 2 * 4
    updates = sum(r["updated"] for r in rows)   # a step whose groups all tied publishes nothing
    assert updates >= 1
    assert versions.latest().version == pipe.trainer.version == 1 + updates
    after = pipe.trainer.model.state_dict()
    assert any(not after[k].equal(v) for k, v in before.items())    # parameters changed


def test_every_sample_carries_a_published_version_within_the_bound(run):
    pipe, samples, versions, _, _ = run
    used = {s["policy_version"] for s in samples}
    assert used <= set(range(1, versions.latest().version + 1))
    assert len(used) > 1                          # the actors followed the new versions
    assert max(pipe.stats.staleness) <= 2


def test_every_actor_holds_each_published_version_bit_identically(run):
    pipe, _, versions, _, _ = run
    reports = pipe.backend.reports
    published = {v: versions.info(v).sha256 for v in range(1, versions.latest().version + 1)}
    assert all(r["sha256"] == published[r["version"]] for r in reports)
    for index in range(2):                        # each actor reported every version in turn
        assert sorted(r["version"] for r in reports if r["index"] == index) == sorted(published)


def test_the_full_state_goes_only_on_first_contact(run):
    pipe, _, _, _, _ = run
    full = Counter((r["index"], r["incarnation"]) for r in pipe.backend.reports if r.get("full"))
    assert full == {(0, 1): 1, (1, 1): 1}


def test_a_killed_actor_is_replaced_and_no_group_is_trained_twice(ray_cluster, ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, steps=5)
    seen = trained_sessions(pipe)

    def first_contact() -> list[dict]:
        return [r for r in pipe.backend.reports if r["index"] == 0 and r["incarnation"] == 2]

    def kill_one(row):
        if row["step"] == 2:
            ray_cluster.kill(pipe.backend.slots[0].actor, no_restart=True)
        if row["step"] == 3:      # hold the trainer until the new actor has come up: on a busy
            deadline = time.monotonic() + 180   # machine its start outlasts the run otherwise
            while not first_contact() and time.monotonic() < deadline:
                time.sleep(0.2)
    pipe.run(on_step=kill_one)
    backend = pipe.backend
    assert pipe.trainer.step_count == 5
    assert backend.replaced == 1 and backend.slots[0].incarnation == 2
    assert len(backend.rerun) == 1                # its group in flight ran again
    assert not [sid for sid, n in Counter(seen).items() if n > 1]
    assert len(seen) == 5 * 2 * 4
    new = first_contact()
    assert new and new[0].get("full")             # the new actor's first contact: full state


def test_an_actor_that_cannot_start_stops_the_run(ray_cluster, ckpt, tmp_path):
    pipe, _, _ = build(ckpt, tmp_path, steps=2)
    pipe.config.ray.max_replacements = 0
    pipe.model_path = tmp_path / "missing"                 # the actor cannot load its policy
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        pipe.run()
    assert "missing" in str(info.value.__cause__) and pipe.trainer.step_count == 0


def test_ray_is_imported_only_when_the_backend_runs():
    code = ("import sys, learner.pipeline, learner.ray_backend, learner.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
