"""Acceptance 1, end to end with a tiny checkpoint: real agent sessions (`apprentice run`),
thumbs through `apprentice feedback`, one `apprentice learn online --once --json` cycle, and a
runtime following the version server swaps to the published version."""

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import SYSTEM, VALID, teach, wait_for  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.cli import main  # noqa: E402
from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from agent_runtime.subscriber import follow  # noqa: E402
from learner.server import ServerConfig, VersionServer  # noqa: E402


LIKED_TASK, DISLIKED_TASK = "Fix add in calc.py", "Rename the module to maths"
# the disliked behaviour: list the workspace instead of reading the file named in the task
LISTING = VALID.replace('"read_file", "arguments": {"path": "calc.py"}',
                        '"list_files", "arguments": {}')


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint taught two behaviours, one per task, so that the liked and the disliked
    sessions are different completions (a random model's are two draws of the same noise).
    Taught, not saturated (~0.8 a token): a completion given at ~0.99 a token (90 steps) has
    almost no room to become likelier, and its shift is then the size of bf16 rounding
    (+0.0001 nats a token measured at 90 steps; +0.004 at 30)."""
    import torch
    torch.set_num_threads(1)
    path = save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
               for task in (LIKED_TASK, DISLIKED_TASK)]
    teach(path, load_policy(str(path), dtype="bfloat16"), prompts, [VALID, LISTING], steps=30)
    return path


def invoke(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def session_of(output: str, tool: str) -> str:
    """The session id of a `run --json` transcript whose one step called `tool`."""
    events = [json.loads(line) for line in output.strip().splitlines()]
    assert [e["name"] for e in events if e["event"] == "tool_start"] == [tool]
    return events[-1]["session_id"]


def test_thumbs_to_a_published_version_that_a_following_runtime_swaps_to(
        ckpt, home, tmp_path, one_thread):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    liked = session_of(invoke("run", LIKED_TASK, "-w", ws, "--model", ckpt,
                              "--max-steps", 1, "--json", code=2), "read_file")
    disliked = session_of(invoke("run", DISLIKED_TASK, "-w", ws, "--model",
                                 ckpt, "--max-steps", 1, "--json", code=2), "list_files")
    invoke("feedback", liked, "up")
    invoke("feedback", disliked, "down", "--reason", "wrong_change")

    server = VersionServer(home / "versions", ServerConfig(port=0, token="t")).start()
    runtime = load_policy(str(ckpt), dtype="bfloat16", max_new_tokens=2)
    following, subscriber = follow(runtime, server.url, "t", SessionStore(tmp_path / "rt"))
    try:
        out = json.loads(invoke("learn", "online", "--once", "--json", "--model", ckpt,
                                "--lr", "1e-3", "--gate-tasks", 0))
        assert set(out) == {"samples", "liked", "disliked", "version", "gate", "logprob_shift"}
        assert (out["samples"], out["liked"], out["disliked"]) == (2, 1, 1)
        assert out["gate"]["passed"] and out["version"] == 2
        assert out["logprob_shift"]["liked"] > 0 > out["logprob_shift"]["disliked"]
        wait_for(lambda: subscriber.staged == 2 or runtime.version == 2, timeout=60.0, interval=0.02)
        completion = following.complete([{"role": "user", "content": "hi"}])
        assert completion.version == 2 and runtime.version == 2
    finally:
        subscriber.stop()
        server.stop()

