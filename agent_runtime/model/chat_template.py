"""Chat templates: the one place that turns messages (and tool schemas) into prompt text.

`ChatTemplate.render` produces exactly what `transformers`' `apply_chat_template(...,
tokenize=False)` produces for the same template: the same sandboxed jinja2 environment
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII and key order), the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...) in the context, messages with `None` fields dropped, and `tools` passed
as the list of JSON schemas. `ChatTemplate.from_pretrained(dir)` reads a checkpoint's
template the way transformers does (`chat_template.jinja` and `additional_chat_templates/`
first, then `tokenizer_config.json`, a string or a list of named templates).

`DEFAULT_CHAT_TEMPLATE` is Qwen2.5's ChatML template with Hermes-style tool calling.

It does not tokenize (see `tokenizer.py`), parse tool calls out of completions (the agent
loop does), or implement `continue_final_message` and assistant-token masks (`{% generation
%}` blocks render their body).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The ChatML turns both templates render the same way: messages, tool calls as <tool_call> JSON,
# tool results grouped into one user turn of <tool_response> blocks, the generation prompt.
_CHATML_TURNS = """\
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen2.5-Instruct's template: ChatML, tools listed in the system turn inside <tools></tools>,
# calls as <tool_call> JSON, results grouped into one user turn of <tool_response> blocks.
DEFAULT_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
""" + _CHATML_TURNS



# The harness our recipe trains its models in: the same ChatML turns and `<tool_call>` format as
# DEFAULT_CHAT_TEMPLATE, but each tool is listed as one line, `name(required, optional?)`, with
# its description only when it is not one of the built-in tools the model was trained with.
# Eight built-ins cost ~40 tokens this way instead of ~1,300 as JSON schemas. A checkpoint
# carries it as its own chat template (and says so in config.json, "apprentice_harness":
# "compact"); third-party checkpoints keep theirs and see full schemas. Plugin and MCP tools
# still reach the model: their signature and first description line are listed.
COMPACT_BUILTIN_TOOLS = ("read_file", "write_file", "edit_file", "list_files", "grep",
                         "semantic_search", "run_command", "finish")
COMPACT_CHAT_TEMPLATE = """\
{%- set builtin = """ + repr(list(COMPACT_BUILTIN_TOOLS)) + """ %}
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n\\n# Tools' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} %}
        {%- set props = params.properties if params.properties is defined else {} %}
        {%- set req = params.required if params.required is defined else [] %}
        {{- '\\n' + fn.name + '(' }}
        {%- for name in props %}
            {{- (', ' if not loop.first else '') + name + ('' if name in req else '?') }}
        {%- endfor %}
        {{- ')' }}
        {%- if fn.name not in builtin and fn.description is defined and fn.description %}
            {{- ': ' + fn.description.split('\\n')[0] }}
        {%- endif %}
    {%- endfor %}
    {{- '\\nCall tools as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
""" + _CHATML_TURNS


class ChatTemplate:
    """One or more named jinja chat templates plus the special tokens they may refer to."""

    def __init__(self, template: str | Mapping[str, str] = DEFAULT_CHAT_TEMPLATE,
                 special_tokens: Mapping[str, str] | None = None):
        self.templates = {"default": template} if isinstance(template, str) else dict(template)
        if not self.templates:
            raise ValueError("a ChatTemplate needs at least one template")
        self.special_tokens = dict(special_tokens or {})   # e.g. {"eos_token": "<|im_end|>"}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ChatTemplate":
        """The template(s) and special tokens of a checkpoint directory, as transformers reads them."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        templates: dict[str, str] = {}
        if (path / CHAT_TEMPLATE_FILE).is_file():
            templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        for file in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
        if not templates:                          # template files take priority over the config
            value = config.get("chat_template")
            if isinstance(value, str):
                templates["default"] = value
            elif isinstance(value, list):
                templates = {t["name"]: t["template"] for t in value}
        if not templates:
            raise ValueError(f"{path}: no chat template (no {CHAT_TEMPLATE_FILE} and no "
                             "chat_template in tokenizer_config.json)")
        # transformers lets a legacy special_tokens_map.json override the config's tokens,
        # unless the config lists added_tokens_decoder (then the legacy file is not read).
        legacy = {} if "added_tokens_decoder" in config else \
            _read_json(path / "special_tokens_map.json")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = _token_text(legacy.get(key) or config.get(key))
            if value is not None:
                special[key] = value
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):                # model-specific named tokens, e.g. image_token
            special.update((k, v) for k, v in ((k, _token_text(v)) for k, v in extra.items())
                           if v is not None)
        return cls(templates, special)

    def source(self, name: str | None = None, tools: Sequence | None = None) -> str:
        """The template text `render` uses: by name, else "tool_use" when tools are given and
        there is one, else "default" (transformers' `get_chat_template`)."""
        if name is not None:
            if name not in self.templates:
                raise ValueError(f"no chat template named {name!r}; have {sorted(self.templates)}")
            return self.templates[name]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ValueError(f"several chat templates and none is 'default': {sorted(self.templates)}; "
                         "pass template=NAME")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True, *, template: str | None = None,
               documents: Sequence[Mapping] | None = None, **extra: Any) -> str:
        """The prompt text for `messages`; `tools` are JSON schemas ({"type": "function",
        "function": {...}}); `extra` reaches the template as variables (it may override the
        special tokens, as in transformers)."""
        if not messages:
            raise ValueError("cannot render an empty conversation")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts, got {message!r:.80}")
            chat.append(_plain({k: v for k, v in message.items() if v is not None}))
        compiled = _compile(self.source(template, tools))
        context = _plain({**self.special_tokens, **extra})
        return compiled.render(messages=_alias_reasoning(chat), tools=_plain(tools),
                               documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **context)

    def __repr__(self) -> str:
        return f"ChatTemplate({sorted(self.templates)}, special_tokens={self.special_tokens})"


def _token_text(value: Any) -> str | None:
    """A special token from a config: a string, or a serialized AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # transformers fills `reasoning_content` (and `thinking`) from whichever name is present.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """Plain JSON-like data only, so a template never sees methods of rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):                          # subclasses, e.g. enums: base type only
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):   # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# -- the jinja environment, as transformers builds it -----------------------------------------

def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (no assistant mask here)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    return env.from_string(source)
