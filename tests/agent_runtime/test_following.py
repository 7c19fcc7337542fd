"""A policy following a real version server applies new versions between model calls only,
and every sample carries the version that produced it."""

import time

import pytest
import torch

from agent_runtime.policies import load_policy
from agent_runtime.store import SessionStore
from agent_runtime.subscriber import follow
from learner.server import ServerConfig, VersionServer
from learner.versions import VersionStore
from tiny_checkpoints import save_tiny_agent_checkpoint

MESSAGES = [{"role": "user", "content": "hi"}]


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


@pytest.fixture
def served(tmp_path):
    policy = load_policy(str(save_tiny_agent_checkpoint(tmp_path / "ckpt")), dtype="bfloat16",
                         max_new_tokens=4)
    versions = VersionStore(tmp_path / "versions")
    versions.publish({k: v.clone() for k, v in policy.model.state_dict().items()})
    server = VersionServer(versions, ServerConfig(port=0, token="secret")).start()
    yield policy, versions, server
    server.stop()


def test_new_version_applies_before_the_next_call_and_is_recorded(served, tmp_path):
    policy, versions, server = served
    store = SessionStore(tmp_path / "home")
    following, subscriber = follow(policy, server.url, "secret", store)
    try:
        wait_for(lambda: subscriber.version == 1)
        assert following.complete(MESSAGES).version == 1
        new = {k: v.clone() for k, v in policy.model.state_dict().items()}
        new["lm_head.weight"][:3] += 1.0
        assert versions.publish(new) == 2
        wait_for(lambda: subscriber.staged == 2)
        assert policy.version == 1                      # staged, not applied: no call yet
        completion = following.complete(MESSAGES)
        assert completion.version == 2 and policy.version == 2
        assert torch.equal(policy.model.lm_head.weight, new["lm_head.weight"])
        assert [v["version"] for v in store.policy_versions()] == [2]
    finally:
        subscriber.stop()


def test_a_wrong_token_never_changes_the_weights(served):
    policy, versions, server = served
    before = policy.model.lm_head.weight.clone()
    following, subscriber = follow(policy, server.url, "wrong", None)
    try:
        new = {k: v.clone() for k, v in policy.model.state_dict().items()}
        new["lm_head.weight"] += 1.0
        versions.publish(new)
        subscriber.status = ""                          # a refusal from now on: after publishing
        wait_for(lambda: "401" in subscriber.status)    # it asked again and was refused
        following.complete(MESSAGES)
        assert policy.version == 0 and torch.equal(policy.model.lm_head.weight, before)
    finally:
        subscriber.stop()
