"""Practice in a learning cycle (`learner.practice`): the serving version runs fresh simulated
training tasks in a store of the learner's own, and only its verified, honest passes are
trained on, beside the user's ratings and not counted as them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import VALID, record_session  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.names import ORIGIN_ROLLOUT  # noqa: E402
from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner.gate import GateConfig  # noqa: E402
from learner.online import OnlineConfig, OnlineLearner  # noqa: E402
from learner.practice import (PRACTICE_DIR, PracticeConfig, PracticeStats,  # noqa: E402
                              passing_samples)
from learner.rollout import Episode  # noqa: E402
from learner.tasks import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def policy(ckpt):
    return load_policy(str(ckpt), dtype="bfloat16")


def episode(sid: str, passed: bool, cheated: bool = False) -> Episode:
    return Episode("fix_bug/train/1", sid, float(passed), passed, cheated, 1, 4, "finished")


def learner(store, ckpt, **practice):
    config = OnlineConfig(model=str(ckpt), gate=GateConfig(n_tasks=0),
                          practice=PracticeConfig(**practice))
    config.trainer.optim.lr = 1e-3
    return OnlineLearner(store, config)


def test_only_passes_the_grader_did_not_flag_become_samples(store, policy):
    passed, failed, cheated = (record_session(store, policy, t, VALID, version=3)
                               for t in ("a", "b", "c"))
    samples = passing_samples(store, [episode(passed, True), episode(failed, False),
                                      episode(cheated, True, cheated=True)], 0.5)
    recorded = store.samples(passed)
    assert [s.session_id for s in samples] == [passed] * len(recorded)
    assert [s.completion_ids for s in samples] == [r["completion_ids"] for r in recorded]
    assert all(s.advantage == 0.5 and s.version == 3 for s in samples)


def test_a_cycle_practises_fresh_training_tasks_in_a_store_of_its_own(store, ckpt, policy):
    online = learner(store, ckpt, tasks=2, max_steps=1, max_new_tokens=8, concurrency=1)
    seen = []
    for text in ("fix it", "fix that"):
        store.add_feedback(1, session_id=record_session(store, policy, text, VALID))
        result = online.run_cycle()
        assert result.practice["tasks"] == 2 and result.to_json()["practice"] == result.practice
        assert result.samples == 1 and result.liked == 1       # the user's sample only
        seen.append(result.cycle_id)
    with SessionStore(online.dir / PRACTICE_DIR) as practice:
        rows = practice.rewards()
        assert [r["task_id"] for r in rows] == [
            t.id for c in seen for t in generate("train", 2, seed=PracticeConfig.seed + c)]
        assert {s["origin"] for s in practice.list_sessions(include_all=True)} == {ORIGIN_ROLLOUT}
    assert len(store.list_sessions(include_all=True)) == 2   # the user's two, nothing more


class Passes:
    """The practice's verdict, fixed: these samples passed."""

    def __init__(self, samples):
        self.samples_ = samples

    def samples(self, version, state, cycle):
        return self.samples_, PracticeStats(1, 1, len(self.samples_))


def test_practice_passes_are_trained_on_beside_the_ratings(store, ckpt, policy, tmp_path):
    """The user's only rating teaches nothing (a thumbs down on a call the grammar wrote:
    test_online), so the cycle's update is the practice pass alone."""
    store.add_feedback(-1, session_id=record_session(store, policy, "fix it", VALID,
                                                     all_forced=True))
    with SessionStore(tmp_path / "practice") as other:
        sid = record_session(other, policy, "implement it", VALID)
        samples = passing_samples(other, [episode(sid, True)], 1.0)
    online = learner(store, ckpt)
    online._practice = Passes(samples)
    result = online.run_cycle()
    assert (result.samples, result.liked, result.disliked) == (1, 0, 1)
    assert result.version == 2
    trainer = online.trainer_for(online.versions.state(2))
    base = online.trainer_for(online.versions.state(1))
    new = trainer.forward_batch(samples)[0].logprobs.mean()
    old = base.forward_batch(samples)[0].logprobs.mean()
    assert new > old
