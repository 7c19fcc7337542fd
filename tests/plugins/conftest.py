"""Fixtures of the plugin tests (helpers are in plugin_support.py)."""

import pytest


@pytest.fixture
def mcp_hub():
    """The process-wide MCP hub, with every server it started stopped after the test."""
    from plugins.mcp_client import hub
    yield hub()
    hub().close()
