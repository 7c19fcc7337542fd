"""Tool-call parsing: tolerant about layout, strict about meaning, never raising."""

import json
from dataclasses import dataclass, field

from hypothesis import given, settings, strategies as st

from agent_runtime.toolcalls import check_calls, parse_tool_calls


@dataclass
class FakeTool:
    name: str
    parameters: dict = field(default_factory=dict)
    description: str = ""
    mutates: bool = False


TOOLS = {t.name: t for t in [
    FakeTool("read_file", {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string", "description": "file to read"},
        "start": {"type": "integer", "minimum": 1}}}),
    FakeTool("edit_file", {"type": "object", "required": ["path", "old", "new"], "properties": {
        "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}}),
    FakeTool("finish", {"type": "object", "properties": {"summary": {"type": "string"}}}),
]}


def call(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def parse(text):
    turn = parse_tool_calls(text)
    check_calls(turn.calls, TOOLS)
    return turn


def test_plain_text_has_no_calls():
    turn = parse("I will look at the code first.")
    assert turn.calls == [] and turn.content == "I will look at the code first."


def test_well_formed_call_is_parsed_and_removed_from_content():
    turn = parse("Reading.\n" + call({"name": "read_file", "arguments": {"path": "a.py"}}))
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("read_file", {"path": "a.py"}, None)]
    assert turn.content == "Reading."


def test_several_blocks_keep_their_order():
    text = call({"name": "read_file", "arguments": {"path": "a"}}) + "\n" + \
        call({"name": "read_file", "arguments": {"path": "b"}})
    assert [c.arguments["path"] for c in parse(text).calls] == ["a", "b"]


def test_layout_slips_are_forgiven():
    variants = [
        '<tool_call>```json\n{"name": "read_file", "arguments": {"path": "a"}}\n```</tool_call>',
        '<tool_call>{"name": "read_file", "arguments": {"path": "a"}}',             # no closing tag
        '<tool_call>  {"name":"read_file","arguments":"{\\"path\\": \\"a\\"}"}  </tool_call>',
        '<tool_call>{"name": "read_file", "parameters": {"path": "a"}}</tool_call>',
        '<tool_call>{"function": {"name": "read_file", "arguments": {"path": "a"}}}</tool_call>',
        '<tool_call>[{"name": "read_file", "arguments": {"path": "a"}}]</tool_call>',
    ]
    for text in variants:
        calls = parse(text).calls
        assert [(c.name, c.arguments, c.error) for c in calls] == [("read_file", {"path": "a"}, None)], text


def test_two_objects_in_one_block_are_two_calls():
    text = '<tool_call>{"name": "read_file", "arguments": {"path": "a"}}\n' \
           '{"name": "finish", "arguments": {}}</tool_call>'
    assert [c.name for c in parse(text).calls] == ["read_file", "finish"]


def test_malformed_json_says_why_and_shows_the_format():
    turn = parse('<tool_call>{"name": "read_file", "arguments": {"path": "a"</tool_call>')
    (c,) = turn.calls
    assert c.name is None and "not valid JSON" in c.error and '"arguments"' in c.error
    assert "<tool_call>" in turn.content                     # the model still sees what it wrote


def test_unknown_tool_lists_the_tools_and_suggests_the_closest():
    (c,) = parse(call({"name": "read_fil", "arguments": {"path": "a"}})).calls
    assert "no tool named 'read_fil'" in c.error and "Did you mean 'read_file'" in c.error
    assert "edit_file, finish, read_file" in c.error


def test_missing_argument_names_it_and_shows_a_call():
    (c,) = parse(call({"name": "edit_file", "arguments": {"path": "a", "old": "x"}})).calls
    assert "missing required argument 'new'" in c.error
    assert '{"name": "edit_file", "arguments": {"path": "<string>", "old": "<string>", "new": "<string>"}}' in c.error


def test_wrong_type_names_expected_and_actual():
    (c,) = parse(call({"name": "read_file", "arguments": {"path": "a", "start": "3"}})).calls
    assert "'start' must be of type integer, got string \"3\"" in c.error


def test_boolean_is_not_an_integer():
    (c,) = parse(call({"name": "read_file", "arguments": {"path": "a", "start": True}})).calls
    assert "must be of type integer, got boolean" in c.error


def test_unexpected_argument_is_an_error():
    (c,) = parse(call({"name": "read_file", "arguments": {"path": "a", "line": 3}})).calls
    assert "unexpected argument 'line'" in c.error and "path, start" in c.error


def test_minimum_is_checked():
    (c,) = parse(call({"name": "read_file", "arguments": {"path": "a", "start": 0}})).calls
    assert "'start' must be >= 1" in c.error


def test_arguments_must_be_an_object():
    (c,) = parse(call({"name": "read_file", "arguments": ["a"]})).calls
    assert '"arguments" of read_file must be a JSON object, got array' in c.error


def test_each_call_gets_a_distinct_id():
    calls = parse(call({"name": "finish", "arguments": {}}) * 3).calls
    assert len({c.id for c in calls}) == 3


# --- fuzzing ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
call_objects = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["read_file", "edit_file", "finish", "nope", ""]) | json_values,
    "arguments": st.dictionaries(st.sampled_from(["path", "old", "new", "start", "x"]), json_values)
    | json_values,
    "extra": json_values})
fragments = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["<tool_call>", "</tool_call>", "```json", "```", "{", "}", '"', ",", "\n"]),
    call_objects.map(json.dumps),
    call_objects.map(lambda o: json.dumps(o)[:-1]),                 # truncated JSON
    call_objects.map(call),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(fragments, max_size=12).map("".join))
def test_fuzzed_text_never_raises_and_every_bad_call_explains_itself(text):
    turn = parse(text)
    for c in turn.calls:
        if c.error is None:
            assert c.name in TOOLS and isinstance(c.arguments, dict)
        else:
            assert c.error.startswith("Error in tool call") and len(c.error) > 40
            assert "<tool_call>" in c.error or "Available tools" in c.error \
                or "Call it like this" in c.error or '"arguments"' in c.error


def test_broken_json_naming_a_known_tool_shows_that_tools_usage():
    text = '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py", "old": "x\n'
    [c] = check_calls(parse_tool_calls(text).calls, TOOLS)
    assert c.name is None and "not valid JSON" in c.error
    assert 'Call it like this:\n<tool_call>\n{"name": "edit_file", "arguments": {"path": ' in c.error
    [c] = check_calls(parse_tool_calls('<tool_call>\n{"name": "frob", "x": \n').calls, TOOLS)
    assert "not valid JSON" in c.error and '{"name": "read_file", "arguments": {"path": ' in c.error
    assert "<tool name>" not in c.error                # a placeholder small models copy
