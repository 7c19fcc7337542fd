"""The mention block: where the task's names are defined, found in a real workspace, shown to
policies trained with it (and kept when a session resumes)."""

import json
import shutil
from pathlib import Path

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.mentions import HEADER, block, workspace_files, with_mentions
from agent_runtime.policies.replay import ReplayPolicy
from agent_runtime.tools.registry import default_tools

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FINISH = "<tool_call>\n" + json.dumps({"name": "finish", "arguments": {"summary": "ok"}}) + \
    "\n</tool_call>"


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_defined_names_come_first_with_file_and_line_then_the_backticked_names_that_are_not():
    ws = {"shop/prices.py": '"""Prices."""\n\n\ndef total(items):\n    return sum(items)\n',
          "tests/test_prices.py": "def total(x):\n    pass\n",
          "shop/cart.py": "class Cart:\n    pass\n"}
    task = ("`compute_total` must replace `total([1, 2])`, which gives `4`; "
            "Cart uses it. Keep `print` working.")
    assert block(task, ws.items()) == "\n".join([
        HEADER,
        "`total`: def in shop/prices.py:4 (+1 more)",  # the test's definition after the code's
        "`Cart`: def in shop/cart.py:1",               # a bare word the code defines
        "`compute_total`: not in the code",            # values and builtins are left out
    ])


def test_a_task_that_names_nothing_the_code_defines_gets_no_block():
    ws = {"shop/prices.py": "def total(items):\n    return sum(items)\n"}
    task = "`python -m shop` prints `3`; make it print `4` via `render`."
    assert block(task, ws.items()) == ""
    assert with_mentions(task, ws.items()) == task


def test_the_workspace_scan_skips_virtualenvs_and_hidden_folders(tmp_path):
    write(tmp_path, {"app/core.py": "def run():\n    pass\n",
                     ".venv/lib/x.py": "def helper():\n    pass\n",
                     ".git/hooks/y.py": "def helper():\n    pass\n",
                     "node_modules/z.py": "def helper():\n    pass\n"})
    assert sorted(p for p, _ in workspace_files(tmp_path)) == ["app/core.py"]
    assert block("call `run` and `helper`", workspace_files(tmp_path)).splitlines()[1:] == \
        ["`run`: def in app/core.py:1", "`helper`: not in the code"]


class Mentioning(ReplayPolicy):
    mentions = True                             # as EnginePolicy says for a checkpoint trained so


def first_prompt(policy, store, session_id) -> str:
    return policy.tokenizer.decode(store.samples(session_id)[0]["prompt_ids"])


def test_the_loop_shows_the_block_to_a_policy_trained_with_it_and_to_no_other(store, tmp_path):
    ws = tmp_path / "calc"
    shutil.copytree(EXAMPLES / "calc", ws)
    task = "`add(2, 3)` returns -1; fix it."
    shown = {}
    for policy, config in ((Mentioning([FINISH]), AgentConfig()),
                           (ReplayPolicy([FINISH]), AgentConfig()),
                           (Mentioning([FINISH]), AgentConfig(mentions=False)),
                           (ReplayPolicy([FINISH]), AgentConfig(mentions=True))):
        result = Agent(policy, default_tools(), store, ws, config=config).run(task)
        shown[len(shown)] = first_prompt(policy, store, result.session_id)
        assert store.get_session(result.session_id)["task"] == task   # what the user wrote
    lookup = f"{task}\n\n{HEADER}\n`add`: def in calc.py:4"
    assert lookup in shown[0] and lookup in shown[3]
    assert HEADER not in shown[1] and HEADER not in shown[2]


def test_a_resumed_session_keeps_the_block_it_started_with(store, tmp_path):
    ws = tmp_path / "calc"
    shutil.copytree(EXAMPLES / "calc", ws)
    task = "`add(2, 3)` returns -1; fix it."
    first = Agent(Mentioning(["thinking"]), default_tools(), store, ws,
                  config=AgentConfig(max_steps=1)).run(task)
    (ws / "calc.py").write_text("def plus(a, b):\n    return a + b\n")   # add is gone now
    policy = Mentioning([FINISH])
    result = Agent(policy, default_tools(), store, ws).resume(first.session_id)
    assert result.status == "finished"
    prompt = policy.tokenizer.decode(store.samples(first.session_id)[-1]["prompt_ids"])
    assert "`add`: def in calc.py:4" in prompt
