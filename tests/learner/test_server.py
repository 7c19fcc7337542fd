"""The version server over real HTTP on 127.0.0.1: auth, endpoints, events, long polling."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load

from agent_runtime import delta
from learner.server import ServerConfig, VersionServer
from learner.versions import StoreConfig, VersionStore

TOKEN = "s3cret"


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}


@pytest.fixture
def served(tmp_path):
    store = VersionStore(tmp_path, StoreConfig(snapshot_every=2))
    states = [make_state(i) for i in range(3)]
    for s in states:
        store.publish(s)
    server = VersionServer(store, ServerConfig(port=0, token=TOKEN, poll_s=0.02,
                                               heartbeat_s=0.2)).start()
    yield server, store, states
    server.stop()


def get(server, path, token=TOKEN, timeout=10):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(server.url + path, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, dict(response.headers), response.read()


def status_of(server, path, token=TOKEN):
    try:
        return get(server, path, token)[0]
    except urllib.error.HTTPError as e:
        return e.code


def test_a_token_is_required_to_start():
    with pytest.raises(ValueError):
        VersionServer("unused", ServerConfig(port=0, token=""))


def test_binds_loopback_by_default():
    assert ServerConfig().host == "127.0.0.1"


@pytest.mark.parametrize("path", ["/latest", "/versions/1", "/delta?from=1&to=2",
                                  "/snapshot/1", "/events", "/find?sha256=x", "/nope"])
def test_nothing_is_served_without_the_token(served, path):
    server, _, _ = served
    assert status_of(server, path, token=None) == 401
    assert status_of(server, path, token="wrong") == 401


def test_latest_and_metadata(served):
    server, store, states = served
    _, _, body = get(server, "/latest")
    assert json.loads(body) == {"version": 3, "sha256": delta.state_sha256(states[2])}
    assert json.loads(get(server, "/versions/2")[2])["sha256"] == delta.state_sha256(states[1])
    sha = delta.state_sha256(states[0])
    assert json.loads(get(server, f"/find?sha256={sha}")[2]) == {"version": 1}


def test_delta_between_any_two_versions(served):
    server, _, states = served
    _, headers, blob = get(server, "/delta?from=1&to=3")
    assert headers["X-Sha256"] == delta.state_sha256(states[2])
    assert delta.state_sha256(delta.apply(states[0], blob)) == delta.state_sha256(states[2])


def test_snapshot_of_any_version(served):
    server, _, states = served
    for version in (1, 2, 3):
        _, headers, data = get(server, f"/snapshot/{version}")
        assert int(headers["Content-Length"]) == len(data)
        assert delta.state_sha256(load(data)) == delta.state_sha256(states[version - 1])


def test_errors_are_clear_statuses(served):
    server, _, _ = served
    assert status_of(server, "/versions/9") == 404
    assert status_of(server, "/delta?from=1&to=9") == 404
    assert status_of(server, "/delta?from=3&to=1") == 404
    assert status_of(server, "/delta?from=x&to=2") == 400
    assert status_of(server, "/find?sha256=abc") == 404


def test_events_announce_the_latest_then_each_new_version(served):
    server, store, _ = served
    request = urllib.request.Request(server.url + "/events",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    versions = []
    with urllib.request.urlopen(request, timeout=10) as stream:
        threading.Timer(0.3, store.publish, [make_state(10)]).start()
        while len(versions) < 2:
            line = stream.readline().decode()
            assert line, "event stream ended early"
            if line.startswith("data:"):
                versions.append(json.loads(line[5:])["version"])
    assert versions == [3, 4]


def test_long_poll_returns_when_a_newer_version_is_published(served):
    server, store, _ = served
    threading.Timer(0.3, store.publish, [make_state(11)]).start()
    start = time.monotonic()
    _, _, body = get(server, "/latest?after=3&wait=20", timeout=30)
    assert json.loads(body)["version"] == 4
    assert time.monotonic() - start < 15


def test_versions_published_by_another_store_object_are_announced(served):
    server, store, _ = served
    VersionStore(store.root).publish(make_state(12))      # e.g. the learner's process
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (server.latest is None or server.latest.version != 4):
        time.sleep(0.02)
    assert server.latest.version == 4
