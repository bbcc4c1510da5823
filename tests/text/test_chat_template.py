"""Specification of chat templates: message normalization, per-message supervision and incremental rendering.

Labels from a template are unshifted: ``labels[i]`` is ``input_ids[i]`` where the token is supervised and
``IGNORE_INDEX`` elsewhere. Expected texts below are written out by hand in each template's format.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer
from hyper_parallel.data.text.chat_template import (
    CHAT_TEMPLATE_REGISTRY,
    ChatMLTemplate,
    ChatTemplate,
    DefaultChatTemplate,
    GptOssChatTemplate,
    Llama2ChatTemplate,
    TokenizerChatTemplate,
    build_chat_template,
    is_supervised,
    message_keys,
    normalize_messages,
)

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# A multi-turn conversation with a system prompt, ShareGPT aliases and two tool turns (function, observation).
RAW_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "human", "content": "What is the capital of France?"},
    {"role": "gpt", "content": "The capital of France is Paris."},
    {"role": "user", "content": "What is the weather there?"},
    {"role": "assistant", "content": "Let me check the forecast."},
    {"role": "function", "content": '{"city": "Paris", "sky": "sunny"}'},
    {"role": "observation", "content": "Sunny, 24 degrees."},
    {"role": "assistant", "content": "It is sunny and 24 degrees in Paris."},
]
CANONICAL_ROLES_OF_RAW = ["system", "user", "assistant", "user", "assistant", "tool", "tool", "assistant"]
CONTENTS = [m["content"] for m in RAW_CONVERSATION]
# Assistant-only supervision by default: messages 2, 4 and 7.
DEFAULT_SUPERVISED = [2, 4, 7]
# The same conversation with loss_mask overrides: the user turn 3 is learned, the assistant turn 4 is not.
OVERRIDE_SUPERVISED = [2, 3, 7]

CHATML_TEXT = "".join(
    f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in zip(CANONICAL_ROLES_OF_RAW, CONTENTS, strict=True)
)

# Jinja templates for tokenizer copies. Literal newlines are template text (rendered as is).
CHATML_WITHOUT_GENERATION_PROMPT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
COUNT_FIRST = "{{ messages|length }} messages\n" + CHATML_WITHOUT_GENERATION_PROMPT
FIRST_MESSAGE_ONLY = "{% if messages|length == 1 %}{{ messages[0]['content'] }}{% endif %}"
# Drops the reasoning of every assistant turn but the last, like several reasoning-model templates.
STRIP_EARLIER_REASONING = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTENTS_ONLY = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# Reads a field of the message besides role and content. (transformers renders with trim_blocks: a newline right
# after a block tag is dropped, so these templates write it in an expression.)
WITH_METADATA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.metadata is defined %} ({{ m.metadata.source }})"
    "{% endif %}{{ '\\n' + m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Shaped like gpt-oss's template: the last assistant turn ends with <|return|>, every other turn with <|end|>, so
# adding a message after an assistant turn rewrites the final token of the previous render.
HARMONY_TOKENS = ("<|start|>", "<|message|>", "<|end|>", "<|return|>")
HARMONY = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' and loop.last %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)
# The same, with a newline after the terminal token: the rewritten token is no longer the render's last.
HARMONY_WITH_NEWLINE = HARMONY.replace("{% endif %}{% endfor %}", "{% endif %}{{ '\\n' }}{% endfor %}")
REJECTS_TOOLS = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool turns are not supported by this template') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def conversation(overrides: bool = False) -> list[dict]:
    raw = [dict(m) for m in RAW_CONVERSATION]
    if overrides:
        raw[3]["loss_mask"] = True
        raw[4]["loss_mask"] = False
    return normalize_messages(raw)


def supervised_spans(ids: np.ndarray, labels: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs of supervised positions; checks every label is its token or IGNORE_INDEX."""
    assert ids.dtype == labels.dtype == np.int64 and ids.shape == labels.shape
    supervised = labels != IGNORE_INDEX
    assert np.array_equal(labels[supervised], ids[supervised])
    spans, start = [], None
    for i, flag in enumerate([*supervised.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def decoded_spans(tokenizer, ids, labels) -> list[str]:
    return [tokenizer.decode(ids[a:b]) for a, b in supervised_spans(ids, labels)]


def tokenizer_with_template(tmp_path: Path, template: str | None):
    """A copy of the bundled tokenizer whose chat_template.jinja is ``template`` (removed when None)."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory)
    if template is None:
        (directory / "chat_template.jinja").unlink()
    else:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return build_tokenizer(directory)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """The bundled tokenizer with gpt-oss's markers added as special tokens, and the HARMONY template."""
    directory = tmp_path_factory.mktemp("harmony") / "tokenizer"
    shutil.copytree(BUNDLED_TOKENIZER_PATH, directory)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens(list(HARMONY_TOKENS))
    backend.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(HARMONY, encoding="utf-8")
    return build_tokenizer(directory)


def message_labels(tokenizer, texts: list[str], supervised: list[bool]) -> np.ndarray:
    """Labels of a render made of ``texts`` (one per message, each split from the next by special tokens): a
    supervised message's tokens, IGNORE_INDEX for the others."""
    pieces = [
        np.asarray(ids if keep else [IGNORE_INDEX] * len(ids), dtype=np.int64)
        for ids, keep in ((tokenizer.encode(text), keep) for text, keep in zip(texts, supervised, strict=True))
    ]
    return np.concatenate(pieces)


def word_level_tokenizer(tmp_path: Path):
    """A tokenizer with neither ChatML markers nor an EOS token."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    return build_tokenizer(path)


# -- normalize_messages ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw_role", "role"),
    [
        ("user", "user"),
        ("assistant", "assistant"),
        ("system", "system"),
        ("tool", "tool"),
        ("human", "user"),
        ("Human", "user"),
        ("gpt", "assistant"),
        ("bot", "assistant"),
        ("model", "assistant"),
        ("function", "tool"),
        ("observation", "tool"),
        ("ASSISTANT", "assistant"),
    ],
)
def test_role_aliases_map_to_canonical_roles(raw_role, role):
    """Built-in aliases (ShareGPT, Gemini, tool formats) map to user/assistant/system/tool, in any case."""
    (message,) = normalize_messages([{"role": raw_role, "content": "x"}])
    assert message == {"role": role, "content": "x"}


def test_role_map_comes_first_exact_then_lower_cased_and_overrides_aliases():
    """role_map is tried before the aliases: exact key, then lower-cased key; it may map to an alias."""
    role_map = {"narrator": "system", "Teacher": "assistant", "gpt": "user", "pupil": "human"}
    raw = [
        {"role": "NARRATOR", "content": "a"},  # lower-cased key
        {"role": "Teacher", "content": "b"},  # exact key
        {"role": "gpt", "content": "c"},  # overrides the gpt -> assistant alias
        {"role": "pupil", "content": "d"},  # mapped to an alias
        {"role": "human", "content": "e"},  # not in role_map: built-in alias
    ]
    roles = [m["role"] for m in normalize_messages(raw, role_map=role_map)]
    assert roles == ["system", "assistant", "user", "user", "user"]


def test_normalize_uses_custom_keys_returns_new_dicts_and_keeps_loss_mask_and_other_fields():
    """ShareGPT keys (from/value) become role/content; other fields are kept as they are (for the template), a
    null loss_mask is no loss_mask, and a field named like the canonical ones is replaced by them."""
    metadata = {"source": "wiki", "turn": 1}
    raw = [
        {"from": "human", "value": "Hi", "weight": 0.5, "metadata": metadata},
        {"from": "gpt", "value": "Hello!", "loss_mask": False},
        {"from": "human", "value": "Bye", "loss_mask": 1, "role": "ignored", "content": "ignored"},
        {"from": "gpt", "value": "Bye!", "loss_mask": None, "name": "helper"},
    ]
    snapshot = [dict(m) for m in raw]
    messages = normalize_messages(raw, role_key="from", content_key="value")
    assert messages == [
        {"role": "user", "content": "Hi", "weight": 0.5, "metadata": {"source": "wiki", "turn": 1}},
        {"role": "assistant", "content": "Hello!", "loss_mask": False},
        {"role": "user", "content": "Bye", "loss_mask": 1},
        {"role": "assistant", "content": "Bye!", "name": "helper"},
    ]
    assert messages[0]["metadata"] is metadata  # values are passed through, not copied
    assert raw == snapshot  # the input is not modified
    assert [is_supervised(m) for m in messages] == [False, False, True, True]


def test_normalize_accepts_tuples_and_object_arrays():
    """Conversations read from Parquet may be tuples or numpy object arrays of dicts."""
    raw = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
    expected = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert normalize_messages(raw) == expected
    assert normalize_messages(np.array(raw, dtype=object)) == expected


WHERE = "record 7 of /data/chat.jsonl"


@pytest.mark.parametrize(
    ("messages", "fragments"),
    [
        ("Hello there", ["must be a list of messages", "got str"]),
        ({"role": "user", "content": "Hi"}, ["must be a list of messages", "got dict"]),
        ([], ["has no messages", "remove the record or add messages"]),
        ([{"role": "user", "content": "Hi"}, "oops"], ["message 1 is a str", "'role'", "'content'"]),
        ([{"content": "Hi"}], ["message 0 has no 'role' field", "['content']", "role_key"]),
        ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], ["message 1", "field 'role'", "non-empty"]),
        ([{"role": 3, "content": "Hi"}], ["message 0", "field 'role' must be a non-empty string, got 3"]),
        (
            [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "b"}],
            ["message 1", "unknown role 'narrator'", "system, user, assistant, tool", "human->user", "role_map"],
        ),
        ([{"role": "user"}], ["message 0 has no 'content' field", "content_key"]),
        ([{"role": "user", "content": None}], ["message 0", "field 'content' must be a string, got null"]),
        (
            [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            ["message 0", "field 'content' must be a string, got list", "flatten"],
        ),
        ([{"role": "user", "content": "Hi", "loss_mask": "yes"}], ["message 0", "'loss_mask'", "true/false or 0/1"]),
        ([{"role": "user", "content": "Hi", "loss_mask": 2}], ["message 0", "'loss_mask'", "got 2"]),
    ],
)
def test_malformed_messages_name_record_position_field_and_fix(messages, fragments):
    """Every malformed conversation is a DataFileError that names the record, the message and the field."""
    with pytest.raises(DataFileError) as raised:
        normalize_messages(messages, where=WHERE)
    message = str(raised.value)
    assert message.startswith(WHERE + ":")
    for fragment in fragments:
        assert fragment in message


def test_custom_field_names_appear_in_errors():
    """Errors name the configured fields, not the defaults."""
    with pytest.raises(DataFileError, match=r"message 0 has no 'from' field"):
        normalize_messages([{"role": "user", "value": "Hi"}], role_key="from", content_key="value")
    with pytest.raises(DataFileError, match=r"message 0 has no 'value' field"):
        normalize_messages([{"from": "user", "content": "Hi"}], role_key="from", content_key="value")


def test_sharegpt_messages_are_recognised_by_their_from_field_without_key_settings():
    """A conversation whose first message has ``from`` and no ``role`` reads ``from``/``value``; one with
    ``role`` reads ``role``/``content``; an explicit key wins over the recognition."""
    sharegpt = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!", "weight": 1}]
    assert normalize_messages(sharegpt) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "weight": 1},
    ]
    parquet = np.empty(2, dtype=object)  # lists of structs read from Parquet arrive as object arrays
    parquet[:] = sharegpt
    assert normalize_messages(parquet) == normalize_messages(sharegpt)
    openai = [{"role": "user", "content": "Hi", "from": "forum"}, {"role": "assistant", "content": "Hello!"}]
    assert [m["content"] for m in normalize_messages(openai)] == ["Hi", "Hello!"]
    assert normalize_messages([{"from": "gpt", "text": "Hello!"}], content_key="text") == [
        {"role": "assistant", "content": "Hello!"}
    ]
    assert message_keys(sharegpt, None, None) == ("from", "value")
    assert message_keys(sharegpt, "speaker", None) == ("speaker", "value")
    assert message_keys(openai, None, None) == ("role", "content")


def test_a_sharegpt_message_missing_its_value_names_the_recognised_field():
    with pytest.raises(DataFileError, match=r"record 3: message 1 has no 'value' field .*content_key"):
        normalize_messages([{"from": "human", "value": "Hi"}, {"from": "gpt"}], where="record 3")


def test_a_role_the_role_map_does_not_cover_names_the_role_the_map_and_the_fix():
    """With a role_map, an unknown role is an error naming it, the roles the map covers and how to add it."""
    raw = [{"from": "customer", "value": "Hi"}, {"from": "agent", "value": "Hello"}]
    role_map = {"customer": "user", "clerk": "assistant"}
    with pytest.raises(DataFileError) as raised:
        normalize_messages(raw, role_map=role_map, where=WHERE)
    message = str(raised.value)
    for fragment in [
        f"{WHERE}: message 1",
        "unknown role 'agent' in field 'from'",
        "role_map (which maps ['clerk', 'customer']) does not cover it",
        "role_map={'agent': 'user'}",
    ]:
        assert fragment in message
    assert [m["role"] for m in normalize_messages(raw, role_map={**role_map, "agent": "assistant"})] == [
        "user",
        "assistant",
    ]


def test_role_map_to_a_non_role_is_a_config_error():
    """A role_map value that is not a role is a DataConfigError naming the entry."""
    with pytest.raises(DataConfigError, match=r"role_map maps 'narrator' to 'narator'.*system, user, assistant, tool"):
        normalize_messages([{"role": "narrator", "content": "x"}], role_map={"narrator": "narator"})


# -- supervision ----------------------------------------------------------------------------------------------------


def test_supervision_defaults_to_assistant_messages_and_loss_mask_overrides_it():
    """Without loss_mask only assistant messages carry loss; loss_mask true/false (or 1/0) decides otherwise."""
    assert [is_supervised(m) for m in conversation()] == [i in DEFAULT_SUPERVISED for i in range(8)]
    assert [is_supervised(m) for m in conversation(overrides=True)] == [i in OVERRIDE_SUPERVISED for i in range(8)]
    assert is_supervised({"role": "system", "content": "", "loss_mask": 1})
    assert not is_supervised({"role": "assistant", "content": "", "loss_mask": 0})


# -- ChatML: the named template and the tokenizer's own ------------------------------------------------------------


@pytest.mark.parametrize("name", ["chatml", "tokenizer"])
@pytest.mark.parametrize(("overrides", "supervised"), [(False, DEFAULT_SUPERVISED), (True, OVERRIDE_SUPERVISED)])
def test_chatml_supervises_content_and_end_of_turn_only(tokenizer, name, overrides, supervised):
    """The ChatML text is rendered with real special tokens; each supervised span is exactly one supervised
    message's content followed by <|im_end|> and a newline (never the <|im_start|>role header)."""
    template = build_chat_template(name, tokenizer)
    ids, labels = template.encode_messages(conversation(overrides))
    assert tokenizer.decode(ids) == CHATML_TEXT
    assert np.array_equal(ids, tokenizer.encode(CHATML_TEXT))
    assert ids[0] == 2 and ids.tolist().count(2) == 8 and ids.tolist().count(3) == 8  # <|im_start|>, <|im_end|>
    assert decoded_spans(tokenizer, ids, labels) == [f"{CONTENTS[i]}{IM_END}\n" for i in supervised]
    # Every header <|im_start|>role\n is unsupervised.
    assert (labels[ids == 2] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "raw",
    [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
        [{"role": "system", "content": "Be terse.", "loss_mask": True}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "user", "content": " leading space"},
            {"role": "assistant", "content": "\nleading newline"},
            {"role": "user", "content": "trailing space "},
            {"role": "assistant", "content": "émoji 🎉 and 日本語", "loss_mask": 1},
            {"role": "assistant", "content": ""},
        ],
        RAW_CONVERSATION,
    ],
)
def test_tokenizer_template_equals_chatml_for_the_bundled_tokenizer(tokenizer, raw):
    """The bundled tokenizer's Jinja template is ChatML: both templates give identical ids and labels."""
    messages = normalize_messages(raw)
    from_jinja = build_chat_template("tokenizer", tokenizer).encode_messages(messages)
    named = build_chat_template("chatml", tokenizer).encode_messages(messages)
    assert np.array_equal(from_jinja[0], named[0])
    assert np.array_equal(from_jinja[1], named[1])
    # And the ids are exactly what transformers renders and tokenizes.
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    rendered = tokenizer.hf.apply_chat_template(plain, tokenize=False)
    assert np.array_equal(named[0], tokenizer.encode(rendered))


def test_tokenizer_template_without_generation_prompt_still_excludes_the_header(tmp_path, tokenizer):
    """A ChatML template that ignores add_generation_prompt: the header is found from the message itself."""
    custom = tokenizer_with_template(tmp_path, CHATML_WITHOUT_GENERATION_PROMPT)
    messages = conversation(overrides=True)
    ids, labels = build_chat_template("tokenizer", custom).encode_messages(messages)
    assert tokenizer.decode(ids) == CHATML_TEXT
    assert decoded_spans(tokenizer, ids, labels) == [f"{CONTENTS[i]}{IM_END}\n" for i in OVERRIDE_SUPERVISED]


def test_tokenizer_template_accepts_an_explicit_jinja_template(tokenizer):
    """TokenizerChatTemplate(tokenizer, template=...) renders that template instead of the tokenizer's own."""
    template = TokenizerChatTemplate(tokenizer, template=CONTENTS_ONLY)
    messages = normalize_messages([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Bye."}])
    ids, labels = template.encode_messages(messages)
    assert tokenizer.decode(ids) == "Hi.Bye."
    assert decoded_spans(tokenizer, ids, labels) == ["Bye."]


# -- incremental rendering: prefix stability ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "fragments"),
    [
        (COUNT_FIRST, ["adding message 1", "rewrites the text of earlier messages"]),
        (FIRST_MESSAGE_ONLY, ["adding message 1", "shrinks the text"]),
    ],
)
def test_template_that_rewrites_its_prefix_fails_when_built(tmp_path, template, fragments):
    """A template whose render of [:k] is not a prefix of the render of [:k+1] is refused at once."""
    custom = tokenizer_with_template(tmp_path, template)
    with pytest.raises(DataConfigError) as raised:
        build_chat_template("tokenizer", custom)
    message = str(raised.value)
    for fragment in [*fragments, "prefix", "not incrementally renderable", "chatml"]:
        assert fragment in message


def test_content_dependent_prefix_rewrite_names_the_record_and_message(tmp_path):
    """A template that drops earlier reasoning passes the start-up check but fails on a record that has some."""
    custom = tokenizer_with_template(tmp_path, STRIP_EARLIER_REASONING)
    template = build_chat_template("tokenizer", custom)
    plain = normalize_messages([{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris."}])
    ids, labels = template.encode_messages(plain)  # no reasoning: renders incrementally
    assert decoded_spans(custom, ids, labels) == [f"Paris.{IM_END}\n"]
    messages = normalize_messages(
        [
            {"role": "user", "content": "Capital?"},
            {"role": "assistant", "content": "<think>France.</think>Paris."},
            {"role": "user", "content": "And Spain?"},
            {"role": "assistant", "content": "Madrid."},
        ]
    )
    with pytest.raises(DataConfigError) as raised:
        template.encode_messages(messages, where=WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "adding message 2 (role 'user')", "prefix", "not incrementally renderable", "chatml"]:
        assert fragment in message


def test_token_level_prefix_instability_is_detected(tmp_path, tokenizer):
    """Text that extends the previous render but tokenizes differently (a merge across messages) is refused."""
    template = TokenizerChatTemplate(tokenizer, template=CONTENTS_ONLY)
    messages = normalize_messages(
        [{"role": "user", "content": "The capital of Fr"}, {"role": "assistant", "content": "ance is Paris."}]
    )
    with pytest.raises(DataConfigError) as raised:
        template.encode_messages(messages, where=WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "adding message 1 (role 'assistant')", "changes the tokens", "prefix", "chatml"]:
        assert fragment in message


def test_template_error_on_a_record_names_record_and_message(tmp_path):
    """A template that raises for some conversation gives a DataFileError with the record and message."""
    custom = tokenizer_with_template(tmp_path, REJECTS_TOOLS)
    template = build_chat_template("tokenizer", custom)
    messages = normalize_messages(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking."},
            {"role": "tool", "content": "sunny"},
        ]
    )
    with pytest.raises(DataFileError) as raised:
        template.encode_messages(messages, where=WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "message 2 (role 'tool')", "tool turns are not supported by this template"]:
        assert fragment in message


def test_tokenizer_without_chat_template_is_a_config_error(tmp_path):
    """chat_template='tokenizer' needs a Jinja template; the error says how to add one or what to use instead."""
    bare = tokenizer_with_template(tmp_path, None)
    with pytest.raises(DataConfigError, match=r"has no chat template; add a chat_template\.jinja.*'chatml'"):
        build_chat_template("tokenizer", bare)
    # A named template needs no Jinja template.
    assert isinstance(build_chat_template("chatml", bare), ChatMLTemplate)


# -- llama2 and default ---------------------------------------------------------------------------------------------


def test_llama2_format_and_labels(tokenizer):
    """System text goes inside the first [INST]; assistant turns are ' {content} ' + EOS, supervised whole."""
    ids, labels = build_chat_template("llama2", tokenizer).encode_messages(conversation())
    expected = (
        "[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nWhat is the capital of France? [/INST]"
        f" The capital of France is Paris. {EOS}"
        f"[INST] What is the weather there? [/INST] Let me check the forecast. {EOS}"
        '[TOOL] {"city": "Paris", "sky": "sunny"} [/TOOL][TOOL] Sunny, 24 degrees. [/TOOL]'
        f" It is sunny and 24 degrees in Paris. {EOS}"
    )
    assert tokenizer.decode(ids) == expected
    assert decoded_spans(tokenizer, ids, labels) == [f" {CONTENTS[i]} {EOS}" for i in DEFAULT_SUPERVISED]
    # Each turn is tokenized as one string, as in Meta's reference code.
    first_turn = tokenizer.encode(
        "[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nWhat is the capital of France? [/INST]"
    )
    assert ids[: len(first_turn)].tolist() == first_turn


def test_llama2_starts_user_and_tool_turns_with_bos_when_the_tokenizer_has_one(tokenizer):
    """With a BOS token, every user and tool turn starts with it (the system text rides in the first user turn)."""
    bos = tokenizer.backend.token_to_id("<|pad|>")
    with_bos = dataclasses.replace(tokenizer, bos_token_id=bos)
    ids, _ = Llama2ChatTemplate(with_bos).encode_messages(conversation())
    assert ids[0] == bos
    assert ids.tolist().count(bos) == 4  # two user turns, two tool turns
    assert tokenizer.decode(ids).startswith("<|pad|>[INST] <<SYS>>\n")


def test_llama2_system_without_following_user_gets_its_own_turn(tokenizer):
    """A system message followed by an assistant message is wrapped in an instruction turn of its own."""
    messages = normalize_messages([{"role": "system", "content": "Be terse."}, {"role": "assistant", "content": "Ok"}])
    ids, labels = Llama2ChatTemplate(tokenizer).encode_messages(messages)
    assert tokenizer.decode(ids) == f"[INST] <<SYS>>\nBe terse.\n<</SYS>>\n\n [/INST] Ok {EOS}"
    assert decoded_spans(tokenizer, ids, labels) == [f" Ok {EOS}"]


def test_default_template_format_and_labels(tokenizer):
    """'{Role}: ' + stripped content + EOS + newline; the role header is never supervised."""
    messages = normalize_messages(
        [
            {"role": "system", "content": "Be terse."},
            {"role": "human", "content": "  Hi there  "},
            {"role": "gpt", "content": "\nHello!\n"},
            {"role": "observation", "content": "42", "loss_mask": True},
        ]
    )
    ids, labels = DefaultChatTemplate(tokenizer).encode_messages(messages)
    expected = f"System: Be terse.{EOS}\nUser: Hi there{EOS}\nAssistant: Hello!{EOS}\nTool: 42{EOS}\n"
    assert tokenizer.decode(ids) == expected
    assert decoded_spans(tokenizer, ids, labels) == [f"Hello!{EOS}\n", f"42{EOS}\n"]
    assert ids.tolist().count(tokenizer.eos_token_id) == 4


def test_chatml_needs_its_markers_and_eos_templates_need_eos(tmp_path):
    """A tokenizer lacking <|im_start|> cannot use chatml; one without EOS cannot use llama2 or default."""
    plain = word_level_tokenizer(tmp_path)
    with pytest.raises(DataConfigError, match=r"needs the token <\|im_start\|>.*'tokenizer'"):
        build_chat_template("chatml", plain)
    for name in ("llama2", "default"):
        with pytest.raises(DataConfigError, match=rf"chat_template '{name}' ends turns with the EOS token"):
            build_chat_template(name, plain)


# -- registry and pickling ------------------------------------------------------------------------------------------


def test_registry_names_and_errors(tokenizer, tokenizer_path):
    """Known names build their class (a path works as tokenizer); an instance is returned as is."""
    assert set(CHAT_TEMPLATE_REGISTRY) == {"tokenizer", "chatml", "llama2", "default", "gpt_oss"}
    expected = {
        "tokenizer": TokenizerChatTemplate,
        "chatml": ChatMLTemplate,
        "llama2": Llama2ChatTemplate,
        "default": DefaultChatTemplate,
    }
    for name, template_class in expected.items():
        assert type(build_chat_template(name, tokenizer)) is template_class
    assert isinstance(build_chat_template("chatml", tokenizer_path), ChatMLTemplate)
    instance = ChatMLTemplate(tokenizer)
    assert build_chat_template(instance, None) is instance
    with pytest.raises(DataConfigError, match=r"unknown chat_template 'chatml2'; use one of tokenizer, chatml, llama2"):
        build_chat_template("chatml2", tokenizer)
    with pytest.raises(DataConfigError, match=r"needs a tokenizer"):
        build_chat_template("chatml", None)


def test_chat_template_is_abstract():
    """ChatTemplate cannot be used without encode_messages."""
    with pytest.raises(TypeError):
        ChatTemplate(None)


@pytest.mark.parametrize("supervise_role_header", [False, True])
@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATE_REGISTRY))
def test_templates_pickle_and_encode_the_same(tokenizer, harmony, name, supervise_role_header):
    """Templates travel to data-loader workers: a pickled copy gives the same ids and labels."""
    template = build_chat_template(
        name, harmony if name == "gpt_oss" else tokenizer, supervise_role_header=supervise_role_header
    )
    messages = conversation(overrides=True)
    ids, labels = template.encode_messages(messages)
    copy = pickle.loads(pickle.dumps(template))
    copy_ids, copy_labels = copy.encode_messages(messages)
    assert np.array_equal(ids, copy_ids) and np.array_equal(labels, copy_labels)
    assert (labels != IGNORE_INDEX).any()


# -- supervise_role_header: upstream's supervision of whole messages ------------------------------------------------


@pytest.mark.parametrize("name", ["chatml", "tokenizer"])
@pytest.mark.parametrize(("overrides", "supervised"), [(False, DEFAULT_SUPERVISED), (True, OVERRIDE_SUPERVISED)])
def test_supervise_role_header_supervises_each_supervised_message_whole(tokenizer, name, overrides, supervised):
    """With supervise_role_header every token of a supervised message is supervised, its <|im_start|>role
    header included; the ids are the same as without it."""
    texts = [
        f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in zip(CANONICAL_ROLES_OF_RAW, CONTENTS, strict=True)
    ]
    expected = message_labels(tokenizer, texts, [i in supervised for i in range(len(texts))])
    ids, labels = build_chat_template(name, tokenizer, supervise_role_header=True).encode_messages(
        conversation(overrides)
    )
    plain_ids, plain_labels = build_chat_template(name, tokenizer).encode_messages(conversation(overrides))
    assert np.array_equal(ids, plain_ids) and np.array_equal(labels, expected)
    assert (labels[ids == 2] != IGNORE_INDEX).sum() == len(supervised)  # one supervised <|im_start|> per message
    # The default differs exactly on the headers of the supervised messages.
    differs = labels != plain_labels
    header_tokens = sum(len(tokenizer.encode(f"{IM_START}{CANONICAL_ROLES_OF_RAW[i]}\n")) for i in supervised)
    assert differs.sum() == header_tokens and (plain_labels[differs] == IGNORE_INDEX).all()


def test_supervise_role_header_in_the_default_and_llama2_templates(tokenizer):
    """default: the '{Role}: ' header joins the supervised span; llama2 has no separate header, so nothing changes."""
    messages = normalize_messages(
        [
            {"role": "system", "content": "Be terse."},
            {"role": "human", "content": "Hi there"},
            {"role": "gpt", "content": "Hello!"},
            {"role": "observation", "content": "42", "loss_mask": True},
            {"role": "user", "content": "Thanks"},
        ]
    )
    ids, labels = DefaultChatTemplate(tokenizer, supervise_role_header=True).encode_messages(messages)
    assert decoded_spans(tokenizer, ids, labels) == [f"Assistant: Hello!{EOS}\nTool: 42{EOS}\n"]
    plain = Llama2ChatTemplate(tokenizer).encode_messages(messages)
    headed = Llama2ChatTemplate(tokenizer, supervise_role_header=True).encode_messages(messages)
    assert all(np.array_equal(a, b) for a, b in zip(plain, headed, strict=True))


def test_supervise_role_header_is_checked_and_named_in_the_repr(tokenizer):
    """The option is a bool; a template keeps its setting (a contradicting option is refused); the repr, which
    a resumed loader compares, names it only when set."""
    plain, headed = ChatMLTemplate(tokenizer), ChatMLTemplate(tokenizer, supervise_role_header=True)
    assert "supervise_role_header" not in repr(plain)
    assert repr(headed).endswith(", supervise_role_header=True)")
    assert build_chat_template(headed, None) is headed
    assert build_chat_template(headed, None, supervise_role_header=True) is headed
    with pytest.raises(DataConfigError, match=r"built with supervise_role_header=True, but supervise_role_header=Fals"):
        build_chat_template(headed, None, supervise_role_header=False)
    with pytest.raises(DataConfigError, match=r"supervise_role_header must be true or false, got 'true'"):
        build_chat_template("chatml", tokenizer, supervise_role_header="true")
    assert build_chat_template("chatml", tokenizer, supervise_role_header=np.bool_(True)).supervise_role_header is True


# -- extra message fields -------------------------------------------------------------------------------------------


def test_extra_message_fields_reach_the_tokenizer_template(tmp_path):
    """A Jinja template sees every field of a message (here metadata); the header search keeps them too, so the
    header it finds is the one the template writes for that message."""
    custom = tokenizer_with_template(tmp_path, WITH_METADATA)
    messages = normalize_messages(
        [
            {"role": "user", "content": "Capital?", "metadata": {"source": "quiz"}},
            {"role": "assistant", "content": "Paris.", "metadata": {"source": "atlas"}},
            {"role": "user", "content": "Thanks"},
        ]
    )
    ids, labels = build_chat_template("tokenizer", custom).encode_messages(messages)
    assert custom.decode(ids) == (
        f"{IM_START}user (quiz)\nCapital?{IM_END}\n{IM_START}assistant (atlas)\nParis.{IM_END}\n"
        f"{IM_START}user\nThanks{IM_END}\n"
    )
    assert decoded_spans(custom, ids, labels) == [f"Paris.{IM_END}\n"]


# -- gpt-oss: the terminal <|return|> -> <|end|> rewrite ------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer", "gpt_oss"])
@pytest.mark.parametrize("supervise_role_header", [False, True])
def test_gpt_oss_terminal_rewrite_is_accepted_and_labelled_with_the_final_token(harmony, name, supervise_role_header):
    """Adding a message after an assistant turn turns its <|return|> into <|end|>: accepted, the ids are the full
    render and the rewritten position is supervised with the <|end|> id. Two assistant turns in a row work too."""
    end, ret = harmony.backend.token_to_id("<|end|>"), harmony.backend.token_to_id("<|return|>")
    template = build_chat_template(name, harmony, supervise_role_header=supervise_role_header)
    assert isinstance(template, GptOssChatTemplate if name == "gpt_oss" else TokenizerChatTemplate)
    header = "<|start|>assistant<|message|>" if supervise_role_header else ""
    cases = [
        (
            ["user", "assistant", "user", "assistant"],
            ["Capital?", "Paris.", "And Spain?", "Madrid."],
            [f"{header}Paris.<|end|>", f"{header}Madrid.<|return|>"],
        ),
        (["user", "assistant", "assistant"], ["Hi", "Hello.", "Anything else?"], None),
    ]
    for roles, contents, spans in cases:
        messages = normalize_messages([{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)])
        ids, labels = template.encode_messages(messages)
        terminals = [
            "<|return|>" if r == "assistant" and k == len(roles) - 1 else "<|end|>" for k, r in enumerate(roles)
        ]
        text = "".join(f"<|start|>{r}<|message|>{c}{t}" for r, c, t in zip(roles, contents, terminals, strict=True))
        assert np.array_equal(ids, harmony.encode(text))
        assert ids.tolist().count(ret) == 1 and ids[-1] == ret
        for position in np.flatnonzero(ids == end):
            is_assistant_turn_end = harmony.decode(ids[:position]).endswith(("Paris.", "Hello."))
            assert labels[position] == (end if is_assistant_turn_end else IGNORE_INDEX)
        if spans is not None:
            assert decoded_spans(harmony, ids, labels) == spans
        else:  # the two assistant turns are adjacent: one span, headers as configured
            assert decoded_spans(harmony, ids, labels) == [
                f"{header}Hello.<|end|><|start|>assistant<|message|>Anything else?<|return|>"
                if supervise_role_header
                else "Hello.<|end|>"
            ] + ([] if supervise_role_header else ["Anything else?<|return|>"])


def test_only_the_terminal_rewrite_of_tokens_the_tokenizer_has_is_accepted(tmp_path, tokenizer, harmony):
    """Without <|return|>/<|end|> tokens the same rewrite of plain text is refused, as is a rewrite of a token
    that is not the render's last; 'gpt_oss' names the token a tokenizer lacks."""
    plain = tokenizer_with_template(tmp_path / "plain", HARMONY)
    with pytest.raises(DataConfigError, match=r"rewrites the text of earlier messages"):
        build_chat_template("tokenizer", plain)
    with pytest.raises(DataConfigError, match=r"chat_template 'gpt_oss' needs the token <\|return\|>"):
        build_chat_template("gpt_oss", plain)
    with pytest.raises(DataConfigError, match=r"rewrites the text of earlier messages"):
        TokenizerChatTemplate(harmony, template=HARMONY_WITH_NEWLINE)
