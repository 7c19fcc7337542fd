"""Fixtures shared by every test folder (a folder's own conftest or module may override one)."""

import os

import pytest

from agent_runtime.store import SessionStore


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private $APPRENTICE_HOME for commands that open the default store."""
    monkeypatch.setenv("APPRENTICE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def store(tmp_path):
    """A real SQLite session store in a private folder."""
    with SessionStore(tmp_path / "home") as s:
        yield s


@pytest.fixture
def one_thread():
    """torch on one intra-op thread: tiny models only pay for the contention of more."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def built():
    """The C++ extension (`agent_runtime.model.fast_decode`), built for this CPU: a failure
    under CI, a skip where there is no toolchain."""
    from agent_runtime.model import fast_decode
    if fast_decode.extension() is None:
        if os.environ.get("CI"):
            pytest.fail(f"the C++ extension did not build: {fast_decode._failed}")
        pytest.skip(f"no C++ toolchain here: {fast_decode._failed}")
