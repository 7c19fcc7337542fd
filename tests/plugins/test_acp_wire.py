"""Bad input on the ACP wire: each gets a JSON-RPC error and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from plugin_support import LinePeer, apprentice_command, call, subprocess_env, write_script

LIMIT = 4096


def raw_agent(tmp_path) -> LinePeer:
    """`apprentice acp` on pipes, spoken to line by line."""
    script = write_script(tmp_path / "script.json", [call("finish", summary="done")])
    return LinePeer(apprentice_command() + ["acp", "--policy", f"replay:{script}",
                                            "--max-message-bytes", str(LIMIT)],
                    subprocess_env(tmp_path / "home"))


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Every kind of bad input in one session, then a valid initialize."""
    agent = raw_agent(tmp_path_factory.mktemp("wire"))
    try:
        out = {
            "not json": agent.send("{this is not json"),
            "array": agent.send("[1, 2, 3]"),
            "no method": agent.send('{"jsonrpc": "2.0", "id": 7}'),
            "oversized": agent.send(json.dumps({"jsonrpc": "2.0", "id": 8, "method": "initialize",
                                                "params": {"pad": "x" * (2 * LIMIT)}})),
            "unknown method": agent.request(9, "session/explode", {}),
            "bad params": agent.request(10, "session/prompt", {"sessionId": "x"}),
            "unknown session": agent.request(11, "session/prompt", {
                "sessionId": "nope", "prompt": [{"type": "text", "text": "hi"}]}),
            "initialize": agent.request(12, "initialize", {"protocolVersion": 1}),
        }
    finally:
        agent.close()
    return out


def test_malformed_json_is_a_parse_error(answers):
    assert (answers["not json"]["id"], answers["not json"]["error"]["code"]) == (None, -32700)


def test_a_json_array_is_an_invalid_request(answers):
    assert answers["array"]["error"]["code"] == -32600


def test_a_message_without_a_method_is_an_invalid_request_with_its_id(answers):
    assert (answers["no method"]["id"], answers["no method"]["error"]["code"]) == (7, -32600)


def test_an_oversized_message_is_refused(answers):
    assert "exceeds the limit" in answers["oversized"]["error"]["data"]["details"]


def test_an_unknown_method_is_method_not_found(answers):
    assert answers["unknown method"]["error"]["code"] == -32601


def test_invalid_params_are_reported(answers):
    assert answers["bad params"]["error"]["code"] == -32602


def test_an_unknown_session_is_an_error(answers):
    assert "unknown session id" in answers["unknown session"]["error"]["data"]["details"]


def test_the_server_keeps_serving_after_bad_input(answers):
    assert answers["initialize"]["result"]["protocolVersion"] == 1
