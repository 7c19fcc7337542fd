"""The call grammar: which tool calls a completion may write, byte by byte, and the generator
and agent loop holding a model to it."""

import json
import os
import random

import pytest
import torch

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.callgrammar import CallGrammar, WorkspaceView
from agent_runtime.model import load_model
from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.policies import load_policy
from agent_runtime.policies.engine import TokenBytes
from agent_runtime.store import SessionStore
from agent_runtime.toolcalls import check_calls, parse_tool_calls
from agent_runtime.tools.registry import default_tools
from fake_policies import GrammarTaker
from tiny_checkpoints import VOCAB, save_hf_checkpoint, save_tiny_agent_checkpoint

STOP = 10_000                                      # a stop token id of the byte matcher


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "mod.py").write_text("def f(x):\n    return x + 1\n")
    (ws / "README.md").write_text("hello\n")
    return ws


@pytest.fixture
def grammar(workspace):
    return CallGrammar(default_tools(), WorkspaceView(workspace))


def written(grammar, text: str | bytes) -> str:
    """Feed `text` one byte per token; "ok" or where the grammar refused it."""
    m = grammar.matcher(lambda t: bytes([t]), stop_ids=[STOP])
    data = text.encode() if isinstance(text, str) else text
    for i, b in enumerate(data):
        if not m.allows(b):
            return f"refused after {data[:i].decode(errors='replace')!r}"
        m.advance(b)
    return "ok"


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.mark.parametrize("text", [
    "Let me look. " + call("read_file", path="pkg/mod.py") + " and more text",
    call("read_file", path="./pkg/mod.py", offset=1, limit=2),
    call("read_file", path="/workspace/README.md"),
    call("edit_file", path="pkg/mod.py", old="(x):\n    return x + 1", new="(x):\n    return x + 2"),
    call("edit_file", path="pkg/mod.py", old="x", new="y", replace_all=True),
    call("list_files", path="pkg/") + call("list_files"),
    call("grep", pattern="return", path="pkg/mod.py"),
    call("write_file", path="new/dir/a.py", content="print(\"\\u00e9\")\n"),
    call("run_command", command="python -m pytest -q"),
])
def test_calls_that_can_run_are_accepted(grammar, text):
    assert written(grammar, text) == "ok"


@pytest.mark.parametrize("text, refused_after", [
    ('<tool_call>\n{"name": "read_fil"}', '"read_fil'),                       # unknown tool
    ('<tool_call>\n{"arguments": {}}', '{"'),                                 # name first
    (call("read_file", path="pkg/mud.py"), '"pkg/m'),                         # no such file
    (call("read_file", path="pkg"), '"pkg'),                                  # a directory
    (call("list_files", path="README.md"), '"path": "'),                      # not a directory
    (call("read_file", path="../x"), '".'),                                   # outside
    (call("read_file", path="pkg//mod.py"), '"pkg/'),                        # empty step
    (call("list_files", path="pkg//"), '"pkg/'),
    (call("edit_file", path="pkg/mod.py", old="return x - 1", new="y"), "return x "),
    (call("edit_file", path="pkg/mod.py", old="x + 1", new="x + 1"), '"new": "x + 1'),
    ('<tool_call>\n{"name": "edit_file", "arguments": {"path": "README.md", "new": "y"}}',
     '"new": "y"'),                                                           # `old` missing
    ('<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md", "path"', '"README.md", "'),
    (call("read_file", path="README.md", offset=1.5), '"offset": 1'),        # not an integer
    ('<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md", "offset": "2"',
     '"offset": '),
    ('<tool_call>\n{"name": "finish", "arguments": {"summary": "a\nb"}}', '"summary": "a'),
    ('<tool_call>\n{"name": "read_file", "arguments": {"content": "x"}}', '{"'),
    ('<tool_call>\n{"name": "list_files", "arguments": {"path": "pkg", "glob": "*",',
     '"glob": "*"'),                                                       # no key left
    (call("grep", pattern="a</tool_call>"), '"a</tool_call'),              # would end the block
    (b'<tool_call>\n{"name": "read_file", "arguments": {"path": "pkg/\xff', '"pkg/'),  # not UTF-8
])
def test_calls_that_cannot_run_are_refused_where_they_go_wrong(grammar, text, refused_after):
    result = written(grammar, text)
    assert result.startswith("refused after") and result.endswith(refused_after + "'"), result


def test_a_name_is_matched_up_to_a_character_cut_short(grammar, workspace):
    (workspace / "café.py").write_text("x = 1\n")
    start = b'<tool_call>\n{"name": "read_file", "arguments": {"path": "caf\xc3'
    assert written(grammar, start + b'\xa9.py"}}') == "ok"
    assert written(grammar, start + b'\xa8').startswith("refused")    # è: no such file
    assert written(grammar, start + b'"').startswith("refused")        # cut short


def test_a_turn_ends_outside_a_block_or_right_after_its_object(grammar):
    m = grammar.matcher(lambda t: bytes([t]), stop_ids=[STOP])
    assert m.allows(STOP)
    m.skip(b'<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"')
    assert not m.allows(STOP)
    m.skip(b"}}")
    assert m.allows(STOP)


def test_no_dead_ends_on_random_walks(grammar):
    """Wherever a block has got to, some byte is allowed (a dead end would leave the
    generator nothing to draw). Random walks over the allowed bytes, seeded."""
    rng = random.Random(3)
    for _ in range(25):
        m = grammar.matcher(lambda t: bytes([t]))
        m.skip(b"<tool_call>\n")
        text = b"<tool_call>\n"
        for _ in range(300):
            allowed = [b for b in range(256) if m.allows(b)]
            assert allowed, f"dead end after {text!r}"
            b = rng.choices(allowed, [8 if chr(b) in '"{}[]:,' else 1 for b in allowed])[0]
            m.advance(b)
            text += bytes([b])
            if not m.in_call:
                break


def test_multi_byte_tokens_are_checked_whole(grammar):
    pieces = [b"<tool_call>\n", b'{"name": "', b"read_file", b'", "arguments": {"path": "',
              b"pkg/", b"mod.py", b'"}}\n</tool_call>']
    bad = b"mud.py"
    table = pieces + [bad]
    m = grammar.matcher(lambda t: table[t])
    for i in range(4):
        m.advance(i)
    m.advance(4)
    assert not m.allows(len(pieces))               # "pkg/mud.py" names nothing
    for i in range(5, len(pieces)):
        m.advance(i)
    assert not m.in_call


def test_workspace_view_sees_files_written_after_the_grammar_was_built(grammar, workspace):
    (workspace / "late.py").write_text("x = 1\n")
    assert written(grammar.at(WorkspaceView(workspace)), call("read_file", path="late.py")) == "ok"


# -- the generator -----------------------------------------------------------------------

class Even:
    """A toy constraint: only even token ids."""
    def allows(self, token):
        return token % 2 == 0

    def advance(self, token):
        assert token % 2 == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("m")), dtype="float32")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generator_draws_only_allowed_tokens_with_the_models_own_logprobs(model, temperature):
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3)
    free = generate(model, [prompt], params)[0]
    held = generate(model, [prompt, prompt], params, constraints=[Even(), None])
    g = held[0]
    assert all(t % 2 == 0 for t in g.tokens)
    assert any(t % 2 for t in free.tokens) and g.forced    # the constraint had work to do
    assert held[1].forced is None or held[1].forced == []
    ids = torch.tensor([prompt + g.tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:].float()
    if temperature:
        logits = logits / temperature
    own = logits.log_softmax(-1).gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
    assert (own - torch.tensor(g.logprobs)).abs().max().item() < 1e-4


@pytest.mark.parametrize("table", [False, True])
def test_engine_writes_a_call_the_grammar_accepts(tmp_path, workspace, table):
    policy = load_policy(str(save_tiny_agent_checkpoint(tmp_path / "ckpt")), temperature=1.0,
                         seed=0, max_new_tokens=200)
    grammar = CallGrammar(default_tools(), WorkspaceView(workspace))
    token_bytes = TokenBytes(policy.tokenizer) if table else policy.token_bytes  # refused()
    m = grammar.matcher(token_bytes, policy.stop_token_ids)                    # on or off
    start = b"<tool_call>\n"
    m.skip(start)
    prompt = policy.tokenizer.encode("<|im_start|>assistant\n<tool_call>\n")
    out = generate(policy.model, [prompt], SamplingParams(max_new_tokens=200, temperature=1.0,
                   seed=0, stop_token_ids=policy.stop_token_ids), constraints=[m])[0]
    assert out.forced                               # random weights: most draws were refused
    text = start + policy.tokenizer.decode_bytes(out.tokens)
    assert written(grammar, text) == "ok"           # bytes: text after a call is free
    free = generate(policy.model, [prompt], SamplingParams(max_new_tokens=200, temperature=1.0,
                    seed=0, stop_token_ids=policy.stop_token_ids))[0]
    assert written(grammar, (start + policy.tokenizer.decode_bytes(free.tokens)).decode(
        errors="replace")) != "ok"


def test_a_refused_first_byte_refuses_every_token_it_starts(tmp_path, workspace):
    policy = load_policy(str(save_tiny_agent_checkpoint(tmp_path / "ckpt")))
    grammar = CallGrammar(default_tools(), WorkspaceView(workspace))
    m = grammar.matcher(TokenBytes(policy.tokenizer), policy.stop_token_ids)
    m.skip(b'<tool_call>\n{"name": "read_file", "arguments": {"path": "pk')
    refused = m.refused()
    allowed = [m.allows(t) for t in range(len(refused))]
    assert not any(a for a, r in zip(allowed, refused.tolist()) if r)    # never a wrong refusal
    assert any(allowed) and refused.sum() > 0.9 * len(refused)           # a path: few go on
    assert not refused[policy.stop_token_ids].any()
    assert grammar.matcher(policy.token_bytes, policy.stop_token_ids).refused() is None


# -- the agent loop ----------------------------------------------------------------------

def test_the_agent_records_which_tokens_the_grammar_chose(tmp_path, workspace):
    """The engine says which tokens the grammar drew in place of the model's own
    (`Completion.meta["forced"]`); the sample keeps them, for the learner
    (`learner.grpo.token_weights`)."""
    class Forcing(GrammarTaker):
        def complete(self, messages, tools=None, *, grammar=None, **kw):
            c = super().complete(messages, tools, grammar=grammar, **kw)
            c.completion_ids, c.logprobs, c.meta = [2, 3, 4], [0.0, -1.0, -2.0], {"forced": [1]}
            return c

    store = SessionStore(tmp_path / "home")
    result = Agent(Forcing(), store=store, workspace=workspace,
                   config=AgentConfig(max_steps=2)).run("Finish.")
    assert [s["forced"] for s in store.samples(result.session_id)] == [[1]]


@pytest.mark.parametrize("constrain, references", [(True, False), (True, True), (False, False)])
def test_agent_hands_the_policy_a_grammar_of_its_tools_and_workspace(tmp_path, workspace,
                                                                      constrain, references):
    """By default the grammar holds the calls' form only (`AgentConfig.check_references`
    off): a path that does not exist, or an edit that changes nothing, is the model's to
    write and the tool's to refuse. With `check_references` the grammar sees the workspace."""
    policy = GrammarTaker()
    store = SessionStore(tmp_path / "home")
    result = Agent(policy, store=store, workspace=workspace,
                   config=AgentConfig(max_steps=2, constrain_calls=constrain,
                                      check_references=references)).run("Finish.")
    assert result.status == "finished"
    (g,) = policy.grammars
    if not constrain:
        assert g is None
        return
    assert set(g.tools) == {t.name for t in default_tools()}
    turn = parse_tool_calls(call("read_file", path="README.md"))
    assert written(g, call("read_file", path="README.md")) == "ok"
    assert not check_calls(turn.calls, {t.name: t for t in default_tools()})[0].error
    missing = call("read_file", path="pkg/mud.py")
    same = call("edit_file", path="pkg/mod.py", old="x + 1", new="x + 1")
    assert written(g, '<tool_call>\n{"name": "read_fil"}').startswith("refused")   # the form
    if references:
        assert g.view.root == os.fsencode(workspace.resolve())
        assert written(g, missing).startswith("refused") and written(g, same).startswith("refused")
    else:
        assert g.view is None
        assert written(g, missing) == "ok" and written(g, same) == "ok"
