"""ChatTemplate renders exactly what transformers' apply_chat_template(tokenize=False) renders."""

from __future__ import annotations

import itertools
import json
from datetime import datetime

import jinja2
import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from agent_runtime.model.chat_template import (COMPACT_CHAT_TEMPLATE, DEFAULT_CHAT_TEMPLATE,  # noqa: E402
                                               ChatTemplate)

# A Mistral/Llama-style template: bos/eos tokens, tools as indented JSON, namespace, continue,
# tojson with separators, raise_exception on unknown roles, indented tags without `-`.
LLAMA_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{% if tools is not none %}
[AVAILABLE_TOOLS]
    {% for tool in tools %}
{{ tool | tojson(indent=4) }}
    {% endfor %}
[/AVAILABLE_TOOLS]
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'user' %}
        {{- '[INST] ' }}{% if ns.system and loop.index0 == 1 %}{{ ns.system + '\\n\\n' }}{% endif %}
        {{- message.content + ' [/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.content is defined %}{{ ' ' + message.content }}{% endif %}
        {%- for call in message.tool_calls | default([]) %}
            {{- '[TOOL_CALLS] ' + (call.function | tojson(separators=(',', ':'))) }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] ' + message.content | tojson + ' [/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace one exact occurrence — once.",
        "parameters": {"type": "object", "required": ["path", "old", "new"], "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the workspace.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                        "timeout": {"type": "integer"}}}}},
]
EDIT = {"type": "function", "function": {"name": "edit_file", "arguments": {
    "path": "calc.py", "old": "a - b", "new": "a + b  # 修正 ✓"}}}
RUN = {"type": "function", "function": {"name": "run_command",
                                        "arguments": {"command": "pytest -q", "timeout": 60}}}
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi there <b>&</b>"}],
    "system_user": [{"role": "system", "content": "You are apprentice."},
                    {"role": "user", "content": "Fix calc.py"}],
    "tool_round_trip": [
        {"role": "system", "content": "You are apprentice."},
        {"role": "user", "content": "Fix calc.py"},
        {"role": "assistant", "content": "Let me fix it.", "tool_calls": [EDIT]},
        {"role": "tool", "name": "edit_file", "content": "Edited calc.py"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks! Now run the tests."}],
    "parallel_calls": [
        {"role": "user", "content": "Fix and test"},
        {"role": "assistant", "content": None, "tool_calls": [EDIT, RUN]},
        {"role": "tool", "content": "Edited calc.py"},
        {"role": "tool", "content": "3 passed in 0.01s"}],
    "string_arguments": [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "run_command",
                                              "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "content": "calc.py\n"}],
}


@pytest.fixture(scope="module")
def backend():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 10, trainer)
    return tok


def hf_tokenizer(backend, template, **special):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                                **special)


CASES = list(itertools.product(CONVERSATIONS, [None, TOOLS], [True, False]))


@pytest.mark.parametrize("template", [DEFAULT_CHAT_TEMPLATE, COMPACT_CHAT_TEMPLATE],
                         ids=["default", "compact"])
@pytest.mark.parametrize("name,tools,generation", CASES)
def test_our_templates_match_transformers(backend, template, name, tools, generation):
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    hf = hf_tokenizer(backend, template, **special)
    expected = hf.apply_chat_template(CONVERSATIONS[name], tools=tools, tokenize=False,
                                      add_generation_prompt=generation)
    ours = ChatTemplate(template, special).render(
        CONVERSATIONS[name], tools=tools, add_generation_prompt=generation)
    assert ours == expected


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_compact_template_renders_turns_like_the_default(name):
    """Only the tool listing differs: every turn after the system turn is the same text."""
    def turns(template):
        text = ChatTemplate(template).render(CONVERSATIONS[name], tools=TOOLS,
                                             add_generation_prompt=True)
        return text.split("<|im_end|>\n", 1)[1]
    assert turns(COMPACT_CHAT_TEMPLATE) == turns(DEFAULT_CHAT_TEMPLATE)


def test_compact_template_lists_one_signature_line_per_tool():
    plugin = {"type": "function", "function": {
        "name": "weather", "description": "Today's weather for a city.\nMore detail.",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
    text = ChatTemplate(COMPACT_CHAT_TEMPLATE).render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tools=TOOLS + [plugin])
    listing = text.split("# Tools\n", 1)[1].split("\nCall tools as", 1)[0].splitlines()
    assert listing == ["edit_file(path, old, new)", "run_command(command?, timeout?)",
                       "weather(city, unit?): Today's weather for a city."]
    assert '"description"' not in text


@pytest.mark.parametrize("name,tools,generation", CASES)
def test_llama_style_template_matches_transformers(backend, name, tools, generation):
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    hf = hf_tokenizer(backend, LLAMA_STYLE, **special)
    expected = hf.apply_chat_template(CONVERSATIONS[name], tools=tools, tokenize=False,
                                      add_generation_prompt=generation)
    ours = ChatTemplate(LLAMA_STYLE, special).render(
        CONVERSATIONS[name], tools=tools, add_generation_prompt=generation)
    assert ours == expected


def test_from_pretrained_reads_tokenizer_config(backend, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA_STYLE, "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    backend.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    chat = CONVERSATIONS["tool_round_trip"]
    assert ChatTemplate.from_pretrained(tmp_path).render(chat, tools=TOOLS) == \
        hf.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_from_pretrained_reads_what_save_pretrained_wrote(backend, tmp_path):
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}
    hf_tokenizer(backend, LLAMA_STYLE, **special).save_pretrained(str(tmp_path))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    chat = CONVERSATIONS["parallel_calls"]
    assert ChatTemplate.from_pretrained(tmp_path).render(chat, tools=TOOLS) == \
        hf.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_named_templates_pick_tool_use_when_tools_are_given(backend, tmp_path, tools):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                          {"name": "tool_use", "template": "tools:{{ tools | length }}"}],
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    backend.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    chat = CONVERSATIONS["user_only"]
    assert ChatTemplate.from_pretrained(tmp_path).render(chat, tools=tools) == \
        hf.apply_chat_template(chat, tools=tools, tokenize=False)


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    (tmp_path / "chat_template.jinja").write_text("file")
    assert ChatTemplate.from_pretrained(tmp_path).render([{"role": "user", "content": ""}]) == "file"


def test_raise_exception_raises_template_error():
    with pytest.raises(jinja2.TemplateError, match="Unknown role: robot"):
        ChatTemplate(LLAMA_STYLE).render([{"role": "robot", "content": "beep"}])


def test_tojson_keeps_unicode_and_key_order():
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}")
    message = {"role": "user", "content": "é <b>"}
    assert template.render([message]) == \
        json.dumps(message, ensure_ascii=False) + "|" + json.dumps(message, ensure_ascii=False,
                                                                    indent=2)


def test_strftime_now_renders_the_current_date():
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([{"role": "user"}])
    assert rendered == datetime.now().strftime("%Y-%m-%d")


def test_templates_run_sandboxed():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.render([{"role": "user", "content": "x"}])
