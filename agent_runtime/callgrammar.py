"""Constrained decoding of tool calls: a model may only write calls that can run.

A small model's calls fail more often on their form than on their intent: measured on the
shipped default model's 40 held-out evaluation episodes (greedy), 24 of the 27 that hit a tool
error hit first a block that was not JSON, a path that does not exist, an `old` text that is
not in the file or a missing argument. `CallGrammar` describes the calls the current tool set
and workspace accept; `CallGrammar.matcher()` follows one completion token by token and says
which next tokens keep it inside that language, and the generator (`model.generate`,
`constraints=`) never samples a token it refuses. What it enforces inside a
`<tool_call>` block (text outside the blocks is free):

    {"name": <a tool's name>, "arguments": {<that tool's arguments>}} then </tool_call>
    - valid JSON; argument names from the tool's schema, each once, every required one present;
      values of the declared type (string, integer, number, boolean, enum, array, object)
    - what a string names, where the tool says (`Tool.references`): "file" an existing file of
      the workspace, "dir" an existing directory, "path" either; "text:ARG" a piece of the file
      that argument ARG names (edit_file's `old`); "differs:ARG" not equal to argument ARG
    - no end-of-turn token inside a block

The agent loop hands the grammar no workspace by default (`AgentConfig.check_references`
off), so it holds the form and leaves what a call names to the tool: with the default model
the workspace checks bought no solved task and walked refused paths and no-op edits into
files the model did not mean (README, "Only the form, by default"). With a workspace view,
paths and file text are checked against the workspace on disk as it is when the call starts
(directories are listed lazily, one `listdir` each). An editor's unsaved buffers are not seen;
the ACP bridge's tools carry no `references`, so there only the form is held. Everything is
checked on bytes, so a token may end inside a UTF-8 character. This module decides what is well formed; it neither samples (the generator
does) nor runs or validates calls after the fact (`toolcalls` does, for every policy).
"""

from __future__ import annotations

import codecs
import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from agent_runtime.sandbox import MOUNT

OPEN, CLOSE = b"<tool_call>", b"</tool_call>"
WS = b" \t\n\r"
MAX_WS = 8                                  # whitespace bytes in a row inside a block
MAX_NUMBER = 20                             # characters of a number
MAX_TEXT_BYTES = 2 * 2**20                  # larger files: `text:` is not checked
_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(rb"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")
_ESCAPES = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b",
            ord("f"): b"\f", ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t"}


@dataclass(frozen=True)
class Spec:
    """What one JSON value may be (from a JSON schema, plus what a string refers to)."""
    types: frozenset[str] = frozenset()          # empty: any JSON value
    enum: tuple[bytes, ...] | None = None        # allowed strings
    refers: str | None = None                    # file | dir | path | text:ARG | differs:ARG
    items: "Spec | None" = None                  # array items
    props: dict[str, "Spec"] | None = None       # object properties (None: any keys)
    required: frozenset[str] = frozenset()

    def allows(self, t: str) -> bool:
        return not self.types or t in self.types or (t == "integer" and "number" in self.types)


ANY = Spec()


def spec_of(schema: dict[str, Any] | None, refers: dict[str, str] | None = None) -> Spec:
    """The `Spec` of a JSON schema; `refers` maps an object's property names to references."""
    schema = schema or {}
    t = schema.get("type")
    types = frozenset([t] if isinstance(t, str) else (t or []))
    enum = schema.get("enum")
    if enum is not None and all(isinstance(e, str) for e in enum):
        enum, types = tuple(e.encode() for e in enum), types or frozenset({"string"})
    else:
        enum = None
    props = schema.get("properties")
    if props is not None:
        props = {k: spec_of(v) for k, v in props.items()}
        for k, ref in (refers or {}).items():
            if k in props:
                props[k] = Spec(props[k].types, props[k].enum, ref)
        if schema.get("additionalProperties", False) is not False:
            props = None                        # any further keys: check none
    items = spec_of(schema["items"]) if isinstance(schema.get("items"), dict) else None
    return Spec(types, enum, None, items, props, frozenset(schema.get("required", [])))


class WorkspaceView:
    """The workspace as the constraint sees it: which paths exist, what files contain. Paths
    are compared as bytes (os.fsencode), so a name is matched up to a character cut short."""

    MOUNT = os.fsencode(MOUNT.rstrip("/") + "/")

    def __init__(self, workspace: str | Path):
        self.root = os.fsencode(os.path.realpath(workspace))
        self._dirs: dict[bytes, list[bytes] | None] = {}
        self._texts: dict[bytes, bytes | None] = {}

    def _rel(self, value: bytes) -> bytes | None:
        """`value` as a workspace-relative path (b"" the root), or None outside it (or not
        UTF-8, a character cut short at the end allowed)."""
        if _utf8_prefix(value) is None:
            return None
        if value.startswith(self.MOUNT):
            value = value[len(self.MOUNT):]
        elif value.startswith(b"/"):
            return None
        while value.startswith(b"./"):
            value = value[2:]
        if b"//" in value:          # an empty step: never needed, and a small model's
            return None             # `tests////...` ran to its token limit
        return value

    def listdir(self, rel: bytes) -> list[bytes] | None:
        """The names in directory `rel`, or None when it is not a directory inside."""
        if rel not in self._dirs:
            path = os.path.join(self.root, rel) if rel else self.root
            try:
                ok = os.path.commonpath([os.path.realpath(path), self.root]) == self.root
                self._dirs[rel] = sorted(os.listdir(path)) if ok and os.path.isdir(path) else None
            except OSError:
                self._dirs[rel] = None
        return self._dirs[rel]

    def may_name(self, value: bytes, kind: str = "path") -> bool:
        """Whether `value` begins the name of something in the workspace: of a file or of a
        directory holding something (`kind` "file"), of a directory ("dir"), either ("path")."""
        if self.MOUNT.startswith(value) or b"./".startswith(value):
            return True
        rel = self._rel(value)
        if rel is None:
            return False
        head, _, last = rel.rpartition(b"/")
        names = self.listdir(head)
        if names is None:
            return False
        if not last and kind != "file":           # "pkg/": the directory itself
            return True
        prefix = head + b"/" if head else b""
        return any(n.startswith(last) and (kind == "path" or self._leads_to(prefix + n, kind))
                   for n in names)

    def _leads_to(self, rel: bytes, kind: str) -> bool:
        """Whether `rel` is, or is a directory on the way to, something of `kind`."""
        inside = self.listdir(rel)
        return kind == "file" and inside is None or inside is not None and (
            kind == "dir" or len(inside) > 0)

    def kind(self, value: bytes) -> str | None:
        """"file", "dir" or None (nothing there, or outside the workspace)."""
        try:
            value.decode("utf-8")               # not inside a character, not broken
        except UnicodeDecodeError:
            return None
        rel = self._rel(value)
        if rel is None:
            return None
        rel = rel.rstrip(b"/")
        if rel in (b"", b"."):
            return "dir"
        head, _, last = rel.rpartition(b"/")
        if last not in (self.listdir(head) or ()):
            return None
        return "dir" if self.listdir(rel) is not None else "file"

    def text(self, value: bytes) -> bytes | None:
        """The file's content (CRLF as LF), or None when it cannot be read as text."""
        rel = self._rel(value)
        if rel is None:
            return None
        if rel not in self._texts:
            self._texts[rel] = None
            path = os.path.join(self.root, rel)
            try:
                if os.path.isfile(path) and os.path.getsize(path) <= MAX_TEXT_BYTES:
                    with open(path, "rb") as f:
                        self._texts[rel] = f.read().replace(b"\r\n", b"\n")
            except OSError:
                pass
        return self._texts[rel]


def _utf8_prefix(data: bytes) -> str | None:
    """`data` decoded, without a last character cut short; None when it is not UTF-8."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return None


class CallGrammar:
    """The tool calls a tool set accepts in a workspace; `matcher()` follows one completion."""

    def __init__(self, tools: Iterable[Any], view: WorkspaceView | None = None):
        self.tools = {t.name: spec_of(t.parameters, getattr(t, "references", None))
                      for t in tools}
        self.names = tuple(n.encode() for n in self.tools)
        self.view = view

    def at(self, view: WorkspaceView | None) -> "CallGrammar":
        """The same tools, seen against `view` (the workspace as it is now)."""
        grammar = copy.copy(self)
        grammar.view = view
        return grammar

    def matcher(self, token_bytes: Callable[[int], bytes], stop_ids: Iterable[int] = ()
                ) -> "CallMatcher":
        return CallMatcher(self, token_bytes, frozenset(stop_ids))


@dataclass(frozen=True)
class _State:
    mode: str = "free"                          # free | json | close
    tail: bytes = b""                           # free: the last bytes (for OPEN); close: matched
    stack: tuple = ()                           # frames, innermost last (see `_Parser`)
    ws: int = 0                                 # whitespace bytes in a row
    done: bool = False                          # json: the call's object is closed


class CallMatcher:
    """Follows one completion: `allows(token)` asks, `advance(token)` takes the token."""

    def __init__(self, grammar: CallGrammar, token_bytes: Callable[[int], bytes],
                 stop_ids: frozenset[int]):
        self.grammar, self.token_bytes, self.stop_ids = grammar, token_bytes, stop_ids
        self.state = _State()
        self._tried: dict[int, _State | None] = {}
        self._first: dict[int, bool] = {}      # first byte -> allowed alone in this state

    @property
    def in_call(self) -> bool:
        return self.state.mode != "free"

    def allows(self, token: int) -> bool:
        if token in self.stop_ids:           # a turn ends outside a block (or right after
                                             # its object: the parser tolerates that)
            return self.state.mode == "free" or (self.state.mode == "json" and self.state.done)
        if token not in self._tried:
            data = self.token_bytes(token)
            if data and not self._first_allowed(data[0]):
                return False                   # the parser reads bytes in order: a token
            self._tried[token] = _Parser(self.grammar, self.state).feed(data)  # whose first
        return self._tried[token] is not None  # byte is refused is refused, whatever follows

    def refused(self) -> Any:
        """A bool tensor [V]: the tokens this state refuses by their first byte alone (stop
        tokens never: `allows` decides them), or None when the token table has no `first`
        index (`policies.engine.TokenBytes`). A draw the grammar refused masks these at once
        instead of finding them one token at a time."""
        first = getattr(self.token_bytes, "first", None)
        if first is None:
            return None
        import torch
        ok = torch.tensor([self._first_allowed(b) for b in range(256)] + [True])
        out = ~ok[first]
        stops = [t for t in self.stop_ids if 0 <= t < len(out)]
        out[stops] = False
        return out

    def _first_allowed(self, byte: int) -> bool:
        """Whether this state takes `byte` as its next byte (memoized per state: a search
        through the vocabulary for an allowed token asks for thousands of tokens that share
        a few hundred first bytes)."""
        ok = self._first.get(byte)
        if ok is None:
            ok = self._first[byte] = _Parser(self.grammar, self.state).feed(bytes([byte])) is not None
        return ok

    def skip(self, text: bytes) -> None:
        """Take text that is already written (a message's prefilled beginning)."""
        state = _Parser(self.grammar, self.state).feed(text)
        if state is None:
            raise ValueError(f"{text!r} is outside the call grammar")
        self.state, self._tried, self._first = state, {}, {}

    def advance(self, token: int) -> None:
        if token not in self.stop_ids:
            if not self.allows(token):
                raise ValueError(f"token {token} is outside the call grammar")
            self.state = self._tried[token]
        self._tried, self._first = {}, {}


class _Parser:
    """One step of the matcher: feeds bytes to a copy of a state; `feed` returns the new state
    or None. Frames are tuples (so a state is copied by reference):
        ("obj", spec, seen, phase, key, values, outer)   phase: open key colon value comma
        ("arr", spec, phase)                             phase: first value comma
        ("str", spec, role, buf, esc, values)            role: key | value; esc: b"" | b"\\" | b"\\u.."
        ("lit", rest)                                    true / false / null still to come
        ("num", spec, text)
    """

    def __init__(self, grammar: CallGrammar, state: _State):
        self.g = grammar
        self.mode, self.tail, self.stack = state.mode, state.tail, list(state.stack)
        self.ws, self.done = state.ws, state.done

    def feed(self, data: bytes) -> _State | None:
        for byte in data:
            if not self._byte(byte):
                return None
        return _State(self.mode, self.tail, tuple(self.stack), self.ws, self.done)

    # -- modes ----------------------------------------------------------------------------
    def _byte(self, b: int) -> bool:
        if self.mode == "free":
            self.tail = (self.tail + bytes([b]))[-len(OPEN):]
            if self.tail == OPEN:
                self.mode, self.tail, self.ws, self.done = "json", b"", 0, False
                self.stack = []
            return True
        if self.mode == "close":
            self.tail += bytes([b])
            if not CLOSE.startswith(self.tail):
                return False
            if self.tail == CLOSE:
                self.mode, self.tail = "free", b""
            return True
        if self.done:                          # after the object: whitespace, then CLOSE
            if b in WS:
                return self._space()
            if b == CLOSE[0]:
                self.mode, self.tail = "close", bytes([b])
                return True
            return False
        self.tail = (self.tail + bytes([b]))[-len(CLOSE):]
        if self.tail.endswith(OPEN) or self.tail == CLOSE:
            return False                       # a tag inside a block would split it
        if not self.stack:                     # before the object
            if b in WS:
                return self._space()
            if b != ord("{"):
                return False
            self.stack.append(("obj", None, frozenset(), "open", None, (), True))
            self.ws = 0
            return True
        return self._json(b)

    def _space(self) -> bool:
        self.ws += 1
        return self.ws <= MAX_WS

    # -- JSON -----------------------------------------------------------------------------
    def _json(self, b: int) -> bool:
        frame = self.stack[-1]
        kind = frame[0]
        if kind == "str":
            return self._str(frame, b)
        if kind == "lit":
            if b != frame[1][0]:
                return False
            self.stack[-1] = ("lit", frame[1][1:])
            if len(frame[1]) == 1:
                self.stack.pop()
                self._pop_value(None)
            return True
        if kind == "num":
            if b in b"0123456789+-.eE":
                self.stack[-1] = ("num", frame[1], frame[2] + bytes([b]))
                return len(frame[2]) < MAX_NUMBER and self._num_prefix_ok(self.stack[-1])
            if not self._num_complete(frame):
                return False
            self.stack.pop()
            self._pop_value(None)
            return self._json(b)               # the byte after a number belongs to its parent
        if b in WS:
            return self._space()
        self.ws = 0
        if kind == "obj":
            return self._obj(frame, b)
        return self._arr(frame, b)

    def _obj(self, frame: tuple, b: int) -> bool:
        _, spec, seen, phase, key, values, outer = frame
        if phase in ("open", "key"):
            if b == ord('"'):
                self.stack.append(("str", None, "key", b"", b"", ()))
                return True
            if b == ord("}") and phase == "open":
                return self._close_obj(frame)
            return False
        if phase == "colon":
            if b != ord(":"):
                return False
            self.stack[-1] = frame[:3] + ("value",) + frame[4:]
            return True
        if phase == "value":
            return self._start_value(self._value_spec(frame), b, values)
        if b == ord(","):                      # phase "comma": only when a key is left
            if (outer and "arguments" in seen) or self._allowed_keys(frame) == []:
                return False
            self.stack[-1] = frame[:3] + ("key",) + frame[4:]
            return True
        if b == ord("}"):
            return self._close_obj(frame)
        return False

    def _value_spec(self, frame: tuple) -> Spec:
        _, spec, _, _, key, values, outer = frame
        if outer:
            if key == "name":
                return Spec(frozenset({"string"}), self.g.names)
            return self.g.tools.get(dict(values).get("name", b"").decode(), ANY)
        if spec is None or spec.props is None:
            return ANY
        return spec.props.get(key, ANY)

    def _allowed_keys(self, frame: tuple) -> Iterable[str] | None:
        _, spec, seen, _, _, _, outer = frame
        if outer:
            return ["name"] if "name" not in seen else ["arguments"]
        if spec is None or spec.props is None:
            return None
        return [k for k in spec.props if k not in seen]

    def _close_obj(self, frame: tuple) -> bool:
        _, spec, seen, _, _, values, outer = frame
        if outer:
            if seen != {"name", "arguments"}:
                return False
            self.stack.pop()
            self.done = True
            return True
        if spec is not None and not spec.required <= seen:
            return False
        self.stack.pop()
        self._pop_value(None)
        return True

    def _arr(self, frame: tuple, b: int) -> bool:
        _, spec, phase = frame
        if phase in ("first", "value"):
            if b == ord("]") and phase == "first":
                self.stack.pop()
                self._pop_value(None)
                return True
            self.stack[-1] = ("arr", spec, "comma")
            return self._start_value(spec.items or ANY, b, ())
        if b == ord(","):
            self.stack[-1] = ("arr", spec, "value")
            return True
        if b == ord("]"):
            self.stack.pop()
            self._pop_value(None)
            return True
        return False

    def _start_value(self, spec: Spec, b: int, values: tuple) -> bool:
        c = chr(b)
        if c == '"' and spec.allows("string"):
            self.stack.append(("str", spec, "value", b"", b"", values))
            return True
        if spec.enum is not None:
            return False
        if c == "{" and spec.allows("object"):
            self.stack.append(("obj", spec if spec.props is not None else None, frozenset(),
                               "open", None, (), False))
            return True
        if c == "[" and spec.allows("array"):
            self.stack.append(("arr", spec, "first"))
            return True
        for word, t in (("true", "boolean"), ("false", "boolean"), ("null", "null")):
            if c == word[0] and spec.allows(t):
                self.stack.append(("lit", word[1:].encode()))
                return True
        if c in "-0123456789" and (spec.allows("number") or spec.allows("integer")):
            self.stack.append(("num", spec, bytes([b])))
            return True
        return False

    def _num_prefix_ok(self, frame: tuple) -> bool:
        text, spec = frame[2], frame[1]
        if not spec.allows("number") and re.search(rb"[.eE]", text):
            return False                        # an integer has no fraction or exponent
        return _NUMBER_PREFIX.fullmatch(text) is not None

    def _num_complete(self, frame: tuple) -> bool:
        return _NUMBER.fullmatch(frame[2]) is not None

    def _pop_value(self, string: bytes | None) -> None:
        """A value just ended; its parent object moves on (and keeps a string value)."""
        if not self.stack:
            return
        parent = self.stack[-1]
        if parent[0] == "obj":
            _, spec, seen, _, key, values, outer = parent
            if string is not None:
                values = values + ((key, string),)
            self.stack[-1] = ("obj", spec, seen, "comma", key, values, outer)

    # -- strings --------------------------------------------------------------------------
    def _str(self, frame: tuple, b: int) -> bool:
        _, spec, role, buf, esc, values = frame
        if esc:
            if esc == b"\\":
                if b == ord("u") and not self._checked(frame):
                    return self._set_str(frame, buf, b"\\u")
                if b not in _ESCAPES:
                    return False
                return self._set_str(frame, buf + _ESCAPES[b], b"")
            if chr(b) not in "0123456789abcdefABCDEF":
                return False
            esc += bytes([b])
            if len(esc) < 6:
                return self._set_str(frame, buf, esc)
            char = chr(int(esc[2:], 16)).encode("utf-8", "surrogatepass")
            return self._set_str(frame, buf + char, b"")
        if b == ord("\\"):               # only where some escape can follow
            if self._checked(frame) and not any(
                    self._prefix_ok(frame[:3] + (buf + e, b"") + frame[5:])
                    for e in _ESCAPES.values()):
                return False
            return self._set_str(frame, buf, b"\\")
        if b == ord('"'):
            return self._end_str(frame)
        if b < 0x20:
            return False                        # JSON strings hold no raw control characters
        return self._set_str(frame, buf + bytes([b]), b"")

    def _checked(self, frame: tuple) -> bool:
        """Whether a string's prefix is checked (a key, an enum, a reference): there, `\\u`
        escapes are not offered (four digits ahead could lead nowhere; such strings can hold
        raw UTF-8 instead)."""
        _, spec, role = frame[:3]
        ref = spec.refers if spec is not None else None
        return role == "key" or spec.enum is not None or (
            ref is not None and not ref.startswith("differs:") and self.g.view is not None)

    def _set_str(self, frame: tuple, buf: bytes, esc: bytes) -> bool:
        self.stack[-1] = frame[:3] + (buf, esc) + frame[5:]
        return esc != b"" or buf == frame[3] or self._prefix_ok(self.stack[-1])

    def _prefix_ok(self, frame: tuple) -> bool:
        _, spec, role, buf, _, values = frame
        if role == "key":
            keys = self._allowed_keys(self.stack[-2])
            return keys is None or any(k.encode().startswith(buf) for k in keys)
        if spec.enum is not None:
            return any(e.startswith(buf) for e in spec.enum)
        ref, view = spec.refers, self.g.view
        if ref is None or view is None:
            return True
        if ref in ("file", "dir", "path"):
            return view.may_name(buf, ref)
        if ref.startswith("text:"):
            text = self._referenced_text(ref, values)
            return text is None or buf in text
        return True

    def _referenced_text(self, ref: str, values: tuple) -> bytes | None:
        """The text of the file that argument ARG of `text:ARG` named (None: not known)."""
        path = dict(values).get(ref.split(":", 1)[1])
        return None if path is None or self.g.view is None else self.g.view.text(path)

    def _end_str(self, frame: tuple) -> bool:
        _, spec, role, buf, _, values = frame
        self.stack.pop()
        parent = self.stack[-1]
        if role == "key":
            key = buf.decode("utf-8", "replace")
            keys = self._allowed_keys(parent)
            if (keys is not None and key not in keys) or key in parent[2]:
                return False
            self.stack[-1] = ("obj", parent[1], parent[2] | {key}, "colon", key, parent[5],
                              parent[6])
            return True
        if not self._complete_ok(spec, buf, values):
            return False
        self._pop_value(buf)
        return True

    def _complete_ok(self, spec: Spec, buf: bytes, values: tuple) -> bool:
        if spec.enum is not None:
            return buf in spec.enum
        ref, view = spec.refers, self.g.view
        if ref is None or view is None:
            return True
        if ref in ("file", "dir"):
            return view.kind(buf) == ref
        if ref == "path":
            return view.kind(buf) is not None
        if ref.startswith("text:"):
            text = self._referenced_text(ref, values)
            return bool(buf) and (text is None or buf in text)
        if ref.startswith("differs:"):
            other = dict(values).get(ref.split(":", 1)[1])
            return other is None or buf != other
        return True
