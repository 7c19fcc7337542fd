"""The version store: numbered versions, snapshots, consecutive and cumulative deltas on disk."""

from __future__ import annotations

import pytest
import torch

from agent_runtime import delta
from learner.versions import StoreConfig, VersionNotFound, VersionStore


def first_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": (torch.randn(200, 64, generator=g) * 0.02).to(torch.bfloat16),
            "layers.0.experts.up": (torch.randn(4, 64, 96, generator=g) * 0.02).to(torch.bfloat16),
            "norm": torch.ones(64)}


def step(state: dict, seed: int) -> dict[str, torch.Tensor]:
    """A small learner-like update: a few bf16 values move by about one ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        noise = torch.randn(t.shape, generator=g) * 1e-3 * (torch.rand(t.shape, generator=g) < 0.05)
        out[name] = (t.float() + noise).to(t.dtype)
    return out


def equal(a: dict, b: dict) -> bool:
    return delta.state_sha256(a) == delta.state_sha256(b)


@pytest.fixture
def history(tmp_path):
    store = VersionStore(tmp_path, StoreConfig(snapshot_every=3))
    states = [first_state()]
    for i in range(6):
        states.append(step(states[-1], i))
    versions = [store.publish(s) for s in states]
    return store, states, versions


def test_versions_count_from_one_and_snapshot_every_n(history):
    store, _, versions = history
    assert versions == [1, 2, 3, 4, 5, 6, 7]
    assert store.latest().version == 7
    assert [v for v in versions if store.info(v).snapshot] == [1, 4, 7]


def test_every_version_materializes_bit_exactly_in_a_fresh_store(history):
    store, states, versions = history
    fresh = VersionStore(store.root)
    for version, state in zip(versions, states):
        assert equal(fresh.state(version), state)
        assert fresh.info(version).sha256 == delta.state_sha256(state)


def test_cumulative_delta_is_one_file_from_any_older_version(history):
    store, states, _ = history
    blob = VersionStore(store.root).delta(2, 7)
    header = delta.read_header(blob)
    assert (header["from_version"], header["to_version"]) == (2, 7)
    assert equal(delta.apply(states[1], blob), states[6])


def test_consecutive_delta_is_the_stored_file(history):
    store, states, _ = history
    assert store.delta_path(5, 6).parent.name == "deltas"
    assert equal(delta.apply(states[4], store.delta(5, 6)), states[5])


def test_snapshot_of_a_version_between_snapshots(history):
    from safetensors.torch import load_file

    store, states, _ = history
    assert equal(load_file(store.snapshot_path(5)), states[4])


def test_publishing_the_latest_state_again_makes_no_new_version(history):
    store, states, _ = history
    assert store.publish(states[-1]) == 7
    assert store.latest().version == 7


def test_store_keeps_its_own_copy_of_published_tensors(tmp_path):
    store = VersionStore(tmp_path)
    state = first_state()
    sha = delta.state_sha256(state)
    store.publish(state)
    state["norm"].add_(1.0)                      # the learner keeps training in place
    assert delta.state_sha256(store.state(1)) == sha


def test_find_by_sha256(history):
    store, states, _ = history
    assert VersionStore(store.root).find(delta.state_sha256(states[3])) == 4
    assert store.find("0" * 64) is None


def test_unknown_versions_raise(history):
    store, _, _ = history
    with pytest.raises(VersionNotFound):
        store.info(99)
    with pytest.raises(VersionNotFound):
        store.delta(5, 3)


def test_a_damaged_delta_on_disk_is_detected(history):
    store, _, _ = history
    path = store.delta_path(4, 5)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(delta.DeltaError):
        VersionStore(store.root).state(5)


def test_mean_of_versions_is_their_elementwise_mean_in_fp32(history):
    store, states, versions = history
    mean = VersionStore(store.root).mean(versions[2:5])
    for name, t in mean.items():
        assert t.dtype == torch.float32
        expected = sum(s[name].float() for s in states[2:5]) / 3
        assert torch.allclose(t, expected, rtol=0, atol=1e-7)
    assert equal({k: v.to(states[0][k].dtype) for k, v in store.mean([1]).items()}, states[0])
    with pytest.raises(ValueError, match="no versions"):
        store.mean([])
