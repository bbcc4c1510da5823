"""Jinja chat templates render in a bounded sandbox: what a template builds can never exhaust memory, and what a
template renders is what ``transformers`` renders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.text.chat_template import TokenizerChatTemplate, normalize_messages

from .test_chat_template import (
    CHATML_WITHOUT_GENERATION_PROMPT,
    RAW_CONVERSATION,
    STRIP_EARLIER_REASONING,
    WITH_METADATA,
)

# Each builds a string, list or number of gigabytes, or renders that much, by another route.
HOSTILE_TEMPLATES = {
    "string times a number": "{% set x = 'a' * 3000000000 %}{{ x|length }}",
    "number times a string": "{% set x = 3000000000 * 'a' %}{{ x|length }}",
    "list times a number": "{% set x = [1] * 10**9 %}{{ x|length }}",
    "a huge range": "{{ range(10**9)|length }}",
    "a huge power": "{{ (2 ** (10 ** 9)) % 7 }}",
    "doubling with ~": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        "{{ ns.s|length }}"
    ),
    "doubling with +": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
        "{{ ns.s|length }}"
    ),
    "a list appended to itself in a loop": (
        "{% set ns = namespace(items=['x']) %}{% for i in range(40) %}{% set ns.items = ns.items + ns.items %}"
        "{% endfor %}{{ ns.items|length }}"
    ),
    "the center filter": "{{ 'a'|center(3000000000) }}",
    "the indent filter": "{{ ('a\\n' * 100000)|indent(1000) }}",
    "the join filter": "{{ ([('a' * 1000000)] * 100000)|join('') }}",
    "the replace filter": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "the format filter": "{{ '%3000000000s'|format('a') }}",
    "the % operator": "{{ '%3000000000s' % 'a' }}",
    "a str method": "{{ 'a'.ljust(3000000000) }}",
    "str.format": "{{ '{:>3000000000}'.format(1) }}",
    "str.join": "{{ ''.join([('a' * 1000000)] * 100000) }}",
    "nested loops writing out": (
        "{% for i in range(100000) %}{% for j in range(100000) %}aaaaaaaaaa{% endfor %}{% endfor %}"
    ),
    "nested loops in a captured block": (
        "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}aaaaaaaaaa{% endfor %}{% endfor %}"
        "{% endset %}{{ x|length }}"
    ),
    "nested loops in a macro": (
        "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}aaaaaaaaaa{% endfor %}"
        "{% endfor %}{% endmacro %}{{ m()|length }}"
    ),
    "tojson of a huge list": "{{ ([[1] * 100000] * 100000)|tojson }}",
}

# Builds each hostile template in a process whose address space is capped about 1.5 GiB above what it holds after
# its imports: an allocation of gigabytes fails there instead of exhausting the machine's memory.
BOUNDED_PROCESS = textwrap.dedent(
    """
    import json, resource, shutil, sys
    from pathlib import Path
    from hyper_parallel.data.errors import DataConfigError
    from hyper_parallel.data.text.build_tokenizer import build_tokenizer
    from hyper_parallel.data.text.chat_template import TokenizerChatTemplate

    templates, bundled, work = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    directory = work / "tokenizer"
    shutil.copytree(bundled, directory)
    build_tokenizer(directory)
    size = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + 3 * 2**29, size + 3 * 2**29))
    results = {}
    for name, template in templates.items():
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
        try:
            TokenizerChatTemplate(build_tokenizer(directory))
            results[name] = "built"
        except DataConfigError as error:
            results[name] = str(error)
        except BaseException as error:
            results[name] = f"{type(error).__name__}: {error}"
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("hostile")
    result = subprocess.run(
        [sys.executable, "-c", BOUNDED_PROCESS, json.dumps(HOSTILE_TEMPLATES), str(BUNDLED_TOKENIZER_PATH), str(work)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {**json.loads(result.stdout.splitlines()[-1]), "directory": str(work / "tokenizer")}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_template_building_gigabytes_is_a_config_error_naming_it_and_the_limit(hostile_results, name):
    message = hostile_results[name]
    template_file = f"{hostile_results['directory']}/chat_template.jinja"
    assert message.startswith(f"the chat template in {template_file}: "), message
    assert "past the limit of 16,777,216" in message and "TEMPLATE_SIZE_LIMIT" in message
    assert "chat_template='chatml'" in message


def test_a_template_that_only_blows_up_on_some_records_is_stopped_on_them(tokenizer):
    """The start-up check passes; the record that makes the template build gigabytes is refused when encoded."""
    template = TokenizerChatTemplate(
        tokenizer,
        "{% if messages|length > 5 %}{{ messages[0]['content'] * 3000000000 }}{% endif %}"
        + CHATML_WITHOUT_GENERATION_PROMPT,
    )
    short = normalize_messages(RAW_CONVERSATION[:4])
    assert len(template.encode_messages(short)[0]) > 0
    with pytest.raises(Exception) as raised:
        template.encode_messages(normalize_messages(RAW_CONVERSATION))
    assert type(raised.value).__name__ == "DataConfigError"
    assert str(raised.value).startswith("the chat template passed as template= ")
    assert "a repetition with '*' would hold" in str(raised.value)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(BUNDLED_TOKENIZER_PATH)


# Renders that exercise what transformers offers a template: loop controls, namespaces, tojson with its options,
# special tokens by name, {% generation %}, raise_exception on a path not taken, dropped None fields, reasoning.
FEATURES = (
    "{{ bos_token or '' }}{% set ns = namespace(count=0) %}{% for m in messages %}{% if m.role == 'tool' %}"
    "{% continue %}{% endif %}{% set ns.count = ns.count + 1 %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking is defined %}[{{ m.thinking|length }}]{% endif %}"
    "{% if m.metadata is defined %}{{ m.metadata|tojson(indent=2) }}{{ m.metadata|tojson }}{% endif %}"
    "{% if m.extra is defined %}{{ raise_exception('no extra') }}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
    "{% endif %}<|im_end|>{{ ns.count }}\n{% if loop.index > 30 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def conversation_with_fields() -> list[dict]:
    messages = normalize_messages(RAW_CONVERSATION)
    messages[1]["metadata"] = {"source": 'é"quoted"', "n": [1, 2.5, None, True]}
    messages[2]["reasoning"] = "thinking it over"
    messages[4]["thinking"] = "thought"
    messages[6]["extra"] = None  # dropped, as transformers drops fields that are None
    return messages


@pytest.mark.parametrize(
    "source",
    [None, CHATML_WITHOUT_GENERATION_PROMPT, WITH_METADATA, STRIP_EARLIER_REASONING, FEATURES],
    ids=["bundled", "chatml", "metadata", "reasoning", "features"],
)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_equal_those_of_apply_chat_template(tokenizer, source, add_generation_prompt):
    template = TokenizerChatTemplate(tokenizer, source)
    messages = conversation_with_fields()
    prefixes = [messages[: k + 1] for k in range(len(messages))]
    expected = tokenizer.hf.apply_chat_template(
        prefixes, chat_template=template.template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template._render(prefixes, add_generation_prompt) == expected


def test_the_template_source_names_the_tokenizer_file(tmp_path):
    directory = tmp_path / "tokenizer"
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory)
    template = TokenizerChatTemplate(build_tokenizer(directory))
    assert template.template_source == f"the chat template in {directory / 'chat_template.jinja'}"
