"""The GRPO trainer on tiny real checkpoints: router replay exactness, updates, versions,
metrics, checkpoints and resume, and reward rising on a trivially learnable task family."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime import delta  # noqa: E402
from agent_runtime.model import load_model  # noqa: E402
from agent_runtime.policy import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner import pipeline  # noqa: E402
from learner.config import (OptimConfig, PipelineConfig, RolloutConfig, RunConfig,  # noqa: E402
                            TrainerConfig)
from learner.grpo import TrainSample  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from learner.versions import VersionStore  # noqa: E402

PROMPTS = ["Fix calc.py so that add() adds.", "List the files.", "Say hello.", "Run the tests."]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2_moe", "granitemoe"])
def ckpt(request, tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"), family=request.param)


def rollouts(ckpt, dtype="float32", n=4, tokens=12, seed=0) -> list[TrainSample]:
    policy = load_policy(str(ckpt), dtype=dtype, temperature=1.0, max_new_tokens=tokens)
    torch.manual_seed(seed)
    out = []
    for i in range(n):
        c = policy.complete([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        out.append(TrainSample(c.prompt_ids, c.completion_ids, c.logprobs, c.routes, c.version,
                               advantage=1.0 if i % 2 else -1.0))
    return out


def trainer(ckpt, run_dir, **kw) -> Trainer:
    config = TrainerConfig(optim=OptimConfig(lr=1e-2), **kw)
    return Trainer(load_model(ckpt, dtype=torch.float32), run_dir, config)


def test_replay_reproduces_behaviour_logprobs_on_policy(ckpt, tmp_path):
    samples = rollouts(ckpt)
    t = trainer(ckpt, tmp_path)
    for s in samples:
        out = t.forward(s, replay=True)
        assert out.logprobs.dtype == torch.float32
        assert (out.logprobs - torch.tensor(s.logprobs)).abs().max() < 1e-5
        assert out.flips == 0 and out.routed == s.routes.shape[0] * s.routes.shape[1]
    m = t.measure(samples)
    assert m["flip_rate"] == 0.0 and m["max_logprob_diff"] < 1e-5 and m["kl"] < 1e-9


def test_replay_forces_the_recorded_experts(ckpt, tmp_path):
    s = rollouts(ckpt, n=1)[0]
    t = trainer(ckpt, tmp_path)
    E = t.model.args.num_experts
    other = ((s.routes.astype(np.int64) + 1) % E).astype(np.uint8)     # a different expert
    forced = TrainSample(**{**s.__dict__, "routes": other})
    replayed = t.forward(forced, replay=True)
    assert replayed.flips == replayed.routed                  # the router would choose others
    assert (replayed.logprobs - torch.tensor(s.logprobs)).abs().max() > 1e-3
    free = t.forward(forced, replay=False)                    # no replay: routes ignored
    assert (free.logprobs - torch.tensor(s.logprobs)).abs().max() < 1e-5


def test_router_gets_gradient_under_replay(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.step(rollouts(ckpt, n=2))
    gates = [b.mlp.gate.weight for b in t.model.layers if b.is_moe]
    assert gates and all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)


def test_step_changes_parameters_and_publishes_a_bf16_version(ckpt, tmp_path):
    versions = VersionStore(tmp_path / "versions")
    store = SessionStore(tmp_path / "home")
    t, extra = Trainer.open(ckpt, tmp_path / "run", TrainerConfig(optim=OptimConfig(lr=1e-2)),
                            versions, store)
    assert extra is None and t.version == 1                   # the initial weights
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    row = t.step(rollouts(ckpt))
    assert row["updated"] == 1 and t.version == 2 and row["version"] == 2
    changed = [k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("gate.weight" in k for k in changed) and "lm_head.weight" in changed
    published = versions.state(2)
    assert all(v.dtype == torch.bfloat16 for v in published.values())
    assert delta.state_sha256(published) == delta.state_sha256(t.published_state())
    assert [v["version"] for v in store.policy_versions()] == [1, 2]


def test_an_empty_batch_skips_the_update(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.publish()
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    row = t.step([])
    assert row["updated"] == 0 and t.version == 1 and t.step_count == 1
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


def test_metrics_are_a_row_per_step_in_sqlite(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.publish()
    samples = rollouts(ckpt)
    t.step(samples, {"reward_mean": 0.5})
    t.step(samples, {"reward_mean": 0.75})
    rows = t.metrics()
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward_mean"] == 0.75
    assert rows[0]["flip_rate"] == 0.0 and rows[0]["kl"] < 1e-9   # step 1 is on-policy
    assert rows[1]["kl"] > rows[0]["kl"]                          # step 2 is one update behind
    t.log_metrics({**rows[1], "reward_mean": 0.1})                # a step redone after resume
    assert [r["reward_mean"] for r in t.metrics()] == [0.5, 0.1]


def test_resume_continues_exactly_where_the_checkpoint_left_off(ckpt, tmp_path):
    samples = rollouts(ckpt)
    versions = VersionStore(tmp_path / "versions")
    config = TrainerConfig(optim=OptimConfig(lr=1e-2), keep_checkpoints=2)
    a, _ = Trainer.open(ckpt, tmp_path / "run", config, versions)
    for _ in range(3):
        a.step(samples, extra_state={"cursor": 7})
    assert [p.name for p in a.checkpoints()] == ["step-00000002.pt", "step-00000003.pt"]
    b, extra = Trainer.open(ckpt, tmp_path / "run", config, versions)
    assert extra == {"cursor": 7} and b.step_count == 3 and b.version == a.version == 4
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    a.step(samples)
    b.step(samples)                                       # same update from the same state
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    assert versions.latest().version == 5                 # b's identical state: no new version


def test_reward_rises_on_a_trivially_learnable_family(tmp_path):
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    config = RunConfig(model=str(ckpt), tasks="toy",
                       trainer=TrainerConfig(optim=OptimConfig(lr=2e-2)),
                       rollout=RolloutConfig(group_size=8, max_new_tokens=8),
                       pipeline=PipelineConfig(mode="sync", steps=10, groups_per_step=2))
    pipe = pipeline.build(config, tmp_path / "run", SessionStore(tmp_path / "home"))
    before = {k: v.detach().clone() for k, v in pipe.trainer.model.state_dict().items()}
    rows = []
    pipe.run(on_step=rows.append)
    rewards = [r["reward_mean"] for r in rows]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15, rewards
    assert rows[0]["updated"] and rows[-1]["version"] > rows[0]["version"]
    changed = sum(not torch.equal(v, before[k]) for k, v in pipe.trainer.model.state_dict().items())
    assert changed > len(before) // 2


def test_optional_kl_penalty_keeps_a_frozen_reference(ckpt, tmp_path):
    config = TrainerConfig(optim=OptimConfig(lr=1e-2))
    config.loss.kl_coef = 0.1
    t = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path, config)
    t.publish()
    samples = rollouts(ckpt, n=2)
    first, second = t.step(samples), t.step(samples)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-9)    # model == reference at step 1
    assert second["ref_kl"] > 0
    assert all(not p.requires_grad for p in t.ref.parameters())
