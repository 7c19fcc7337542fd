"""Tool-call parsing and argument checking: strict about meaning, tolerant about layout.

`parse_tool_calls` finds the Hermes-style blocks in an assistant message

    <tool_call>
    {"name": "read_file", "arguments": {"path": "calc.py"}}
    </tool_call>

and `check_calls` validates each one against the tools' JSON schemas. Layout slips are
forgiven (extra whitespace, a Markdown code fence inside the block, a missing closing tag at
the end of the message, several objects or a list in one block, `arguments` given as a JSON
string, `parameters` for `arguments`, an OpenAI-style `{"function": {...}}` wrapper). Errors of
meaning (malformed JSON, an unknown tool, a missing, unexpected or wrong-typed argument) never
raise: they are written into `ToolCall.error` as a message for the model that says what was
wrong and how to make the call. This module does not run tools; the agent loop does.
"""

from __future__ import annotations

import difflib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)
_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
DURATION = re.compile(r"\b\d+(\.\d+)?\s?(s|ms|sec|seconds)\b")   # `8 passed in 0.02s`
# A concrete call, not `{"name": "<tool name>", ...}`: small models copy a placeholder name
# verbatim, and then every call fails the same way.
FORMAT_HINT = ('Write each call as one JSON object, for example\n<tool_call>\n'
               '{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>')
_NAMED = re.compile(r'^\s*\{\s*"name"\s*:\s*"([^"\\]+)"')


@dataclass
class ToolCall:
    """One call as the model wrote it; `error` is set when it cannot run."""
    name: str | None                           # None when the block was not a JSON call
    arguments: dict[str, Any] | None
    raw: str                                   # the block's text as written
    error: str | None = None                   # message for the model, or None when valid
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI-style entry for an assistant message's `tool_calls`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments or {}}}


@dataclass
class ParsedTurn:
    content: str                               # the text with well-formed blocks removed
    calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split an assistant message into its prose and its tool calls (valid or not)."""
    calls: list[ToolCall] = []
    kept: list[str] = []                       # content pieces, malformed blocks left verbatim
    pos = 0
    for m in _BLOCK.finditer(text):
        kept.append(text[pos:m.start()].replace(CLOSE, ""))   # a stray closing tag
        pos = m.end()
        block_calls = _parse_block(m.group(1), len(calls))
        calls.extend(block_calls)
        if any(c.name is None for c in block_calls):
            kept.append(m.group(0))            # the model should see what it wrote
    kept.append(text[pos:].replace(CLOSE, ""))
    content = "".join(kept)
    content = re.sub(r"\n{3,}", "\n\n", content).strip()
    return ParsedTurn(content, calls)


def _parse_block(body: str, index: int) -> list[ToolCall]:
    raw = body.strip()
    inner = raw
    fence = _FENCE.match(inner)
    if fence:
        inner = fence.group(1).strip()
    if not inner:
        return [_broken(raw, index, "the <tool_call> block is empty")]
    objects, err = _decode_all(inner)
    if err:
        return [_broken(raw, index, err)]
    calls = []
    for obj in objects:
        for item in (obj if isinstance(obj, list) else [obj]):
            calls.append(_to_call(item, raw, index + len(calls)))
    return calls or [_broken(raw, index, "the block holds an empty list")]


def _decode_all(text: str) -> tuple[list[Any], str | None]:
    """Decode one or more JSON values laid end to end."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return [], f"the block is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        out.append(value)
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
    return out, None


def _to_call(obj: Any, raw: str, index: int) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]                  # OpenAI-style wrapper
    if not isinstance(obj, dict):
        return _broken(raw, index, f"expected a JSON object, got {_json_type(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _broken(raw, index, 'the object has no "name" string')
    extra = sorted(set(obj) - {"name", "arguments", "parameters", "id", "type"})
    if extra:
        return _broken(raw, index, f'unexpected key(s) {", ".join(map(repr, extra))} next to '
                       '"name"; put the tool\'s arguments inside "arguments"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                  # arguments as a JSON string (OpenAI style)
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, None, raw, _error(index, f'"arguments" of {name} is a string '
                                                   f"that is not valid JSON ({e.msg})"))
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, _error(
            index, f'"arguments" of {name} must be a JSON object, got {_json_type(args)}'))
    return ToolCall(name, args, raw)


def _broken(raw: str, index: int, why: str) -> ToolCall:
    return ToolCall(None, None, raw, _error(index, why) + "\n" + FORMAT_HINT)


def _error(index: int, why: str) -> str:
    return f"Error in tool call {index + 1}: {why}."


# --- checking calls against the tools' schemas ---------------------------------------------

def check_calls(calls: list[ToolCall], tools: dict[str, Any]) -> list[ToolCall]:
    """Set `error` on every call that names an unknown tool or has bad arguments."""
    for i, call in enumerate(calls):
        if call.name is None and call.error and call.error.endswith(FORMAT_HINT):
            named = _NAMED.match(call.raw)           # broken JSON, but we see which tool
            if named and named.group(1) in tools:
                call.error = call.error[:-len(FORMAT_HINT)] + usage(tools[named.group(1)])
        if call.error or call.name is None:
            continue
        tool = tools.get(call.name)
        if tool is None:
            near = difflib.get_close_matches(call.name, list(tools), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            call.error = _error(i, f"there is no tool named {call.name!r}.{hint} Available "
                                "tools: " + ", ".join(sorted(tools))) + "\n" + FORMAT_HINT
            continue
        problems = check_args(tool.parameters or {}, call.arguments or {})
        if problems:
            call.error = (_error(i, f"bad arguments for {call.name}: " + "; ".join(problems))
                          + "\n" + usage(tool))
    return calls


def check_args(schema: dict[str, Any], args: dict[str, Any]) -> list[str]:
    """Problems with `args` against an object schema, each a short sentence for the model."""
    props = schema.get("properties", {}) or {}
    problems = [f"missing required argument {k!r} ({_describe(props.get(k, {}))})"
                for k in schema.get("required", []) if k not in args]
    for key, value in args.items():
        if key not in props:
            if schema.get("additionalProperties", False) is False:
                problems.append(f"unexpected argument {key!r} (accepted: "
                                + (", ".join(props) or "none") + ")")
            continue
        problems.extend(_check_value(props[key], value, key))
    return problems


def _check_value(schema: dict[str, Any], value: Any, where: str) -> list[str]:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    if types and not any(_is_type(value, t) for t in types):
        return [f"argument {where!r} must be of type {' or '.join(types)}, got {_json_type(value)} "
                f"{_short(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"argument {where!r} must be one of {', '.join(map(json.dumps, schema['enum']))}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return [f"argument {where!r} must be >= {schema['minimum']}, got {value}"]
        if "maximum" in schema and value > schema["maximum"]:
            return [f"argument {where!r} must be <= {schema['maximum']}, got {value}"]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found = _check_value(schema["items"], item, f"{where}[{i}]")
            if found:
                return found
    if isinstance(value, dict) and "properties" in schema:
        return [f"in {where!r}: {p}" for p in check_args(schema, value)]
    return []


def _is_type(value: Any, t: str) -> bool:
    if t not in _JSON_TYPES:
        return True                            # a type this checker does not know: accept
    return _json_type(value) == t or (t == "number" and _json_type(value) == "integer")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name, py in (("null", type(None)), ("integer", int), ("number", float),
                     ("string", str), ("array", list), ("object", dict)):
        if isinstance(value, py):
            return name
    return type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(schema: dict[str, Any]) -> str:
    t = schema.get("type", "any")
    t = " or ".join(t) if isinstance(t, list) else t
    desc = schema.get("description")
    return f"{t}: {desc}" if desc else t


def usage(tool: Any) -> str:
    """How to call `tool`: a valid example with the required arguments, then every argument."""
    schema = tool.parameters or {}
    props, required = schema.get("properties", {}) or {}, schema.get("required", [])
    example = {k: _placeholder(props.get(k, {})) for k in required}
    lines = [f"Call it like this:\n{OPEN}\n"
             + json.dumps({"name": tool.name, "arguments": example}) + f"\n{CLOSE}"]
    if props:
        lines.append("Arguments of " + tool.name + ": " + "; ".join(
            f"{k} ({_describe(v)}{', required' if k in required else ', optional'})"
            for k, v in props.items()))
    return "\n".join(lines)


def _placeholder(schema: dict[str, Any]) -> Any:
    t = schema.get("type")
    t = t[0] if isinstance(t, list) and t else t
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    return {"integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}.get(
        t, "<" + (t or "value") + ">")


def visible_text(raw: str) -> str:
    """Assistant text as a user should see it while it streams: `<tool_call>` blocks (shown
    as tool events instead) removed, a tag still arriving held back, outer whitespace stripped."""
    text = _BLOCK.sub("", raw)                 # exactly the blocks the parser reads as calls
    for n in range(len(OPEN) - 1, 0, -1):
        if text.endswith(OPEN[:n]):
            text = text[:-n]
            break
    return text.strip()


def call_key(name: str | None, arguments: Any, result: str | None) -> str:
    """What makes two tool calls the same call with the same result: the tool, its arguments
    and its result with durations left out (a test run prints a new one every time). The
    agent's stuck detector and the learner's `repeated_call` signal both compare these."""
    return json.dumps([name, arguments, DURATION.sub("", result or "")], sort_keys=True)
