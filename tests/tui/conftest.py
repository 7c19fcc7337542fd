"""Fixtures of the TUI tests: a private $APPRENTICE_HOME and $HOME, a calc workspace, and
`async def` tests run on a fresh event loop (no pytest-asyncio needed)."""

import asyncio
import inspect

import pytest

from tui_support import make_workspace


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), timeout=60))
    return True


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))         # the workspace shows as ~/calc
    monkeypatch.setenv("APPRENTICE_EMBEDDINGS", "off")
    return tmp_path / "home"


@pytest.fixture
def workspace(tmp_path):
    return make_workspace(tmp_path)
