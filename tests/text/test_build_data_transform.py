"""Specification of the record transforms: records in, ModelSamples with shifted labels out.

A ModelSample is ``{"input_ids", "labels"}``, two int64 arrays of the same length where ``labels[i]`` is the
token that follows ``input_ids[i]`` (``IGNORE_INDEX``: no loss). Expected tokens come from encoding
hand-written text with the bundled tokenizer.
"""

from __future__ import annotations

import logging
import math
import pickle

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_data_transform import (
    DATA_TRANSFORM_REGISTRY,
    IdentityDataTransform,
    PlaintextTransform,
    TextConversationTransform,
    build_llm_data_transform,
)
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.text.chat_template import ChatMLTemplate

IM_END, EOS = "<|im_end|>", "<|endoftext|>"
WHERE = "record 17 of /data/train.jsonl"

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families."
)

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "human", "content": "What is the capital of France?"},
    {"role": "gpt", "content": "The capital of France is Paris."},
    {"role": "user", "content": "What is the weather there?", "loss_mask": True},
    {"role": "assistant", "content": "Let me check the forecast.", "loss_mask": False},
    {"role": "function", "content": '{"city": "Paris", "sky": "sunny"}'},
    {"role": "observation", "content": "Sunny, 24 degrees."},
    {"role": "assistant", "content": "It is sunny and 24 degrees in Paris."},
]
ROLES = ["system", "user", "assistant", "user", "assistant", "tool", "tool", "assistant"]
SUPERVISED = [2, 3, 7]  # assistant turns, plus the user turn with loss_mask, minus the assistant turn without
CHATML_TEXT = "".join(
    f"<|im_start|>{role}\n{m['content']}{IM_END}\n" for role, m in zip(ROLES, CONVERSATION, strict=True)
)


@pytest.fixture
def warnings_of_this_package(caplog):
    """Capture this package's warnings even if another test switched its propagation off."""
    logger = logging.getLogger("hyper_parallel.data")
    propagate = logger.propagate
    logger.propagate = True
    caplog.set_level(logging.WARNING, logger="hyper_parallel.data")
    yield caplog
    logger.propagate = propagate


def assert_model_sample(sample: dict) -> None:
    assert set(sample) == {"input_ids", "labels"}
    ids, labels = sample["input_ids"], sample["labels"]
    assert ids.dtype == labels.dtype == np.int64
    assert ids.ndim == labels.ndim == 1 and len(ids) == len(labels) >= 1


def supervised_spans(labels: np.ndarray) -> list[tuple[int, int]]:
    flags = [*(labels != IGNORE_INDEX).tolist(), False]
    spans, start = [], None
    for i, flag in enumerate(flags):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


# -- plaintext ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seq_len", [1, 2, 7, 16, 64, 10_000])
def test_plaintext_windows_cover_the_document_without_loss(tokenizer, max_seq_len):
    """n tokens (text + EOS) give n-1 pairs in consecutive windows of max_seq_len; input_ids of the windows
    followed by the last label rebuild the document."""
    document = tokenizer.encode(TEXT) + [tokenizer.eos_token_id]
    samples = PlaintextTransform(tokenizer, max_seq_len=max_seq_len)({"text": TEXT}, WHERE)
    pairs = len(document) - 1
    assert len(samples) == math.ceil(pairs / max_seq_len)
    for sample in samples:
        assert_model_sample(sample)
    lengths = [len(s["input_ids"]) for s in samples]
    assert lengths[:-1] == [max_seq_len] * (len(samples) - 1)
    assert lengths[-1] == pairs - max_seq_len * (len(samples) - 1)
    inputs = np.concatenate([s["input_ids"] for s in samples])
    labels = np.concatenate([s["labels"] for s in samples])
    assert inputs.tolist() + [int(labels[-1])] == document
    assert labels.tolist() == document[1:]
    assert labels[-1] == tokenizer.eos_token_id == 0
    assert (labels != IGNORE_INDEX).all()


def test_plaintext_labels_do_not_share_memory_with_input_ids(tokenizer):
    """Editing labels in place (e.g. masking) cannot change input_ids."""
    (sample,) = PlaintextTransform(tokenizer, max_seq_len=4096)({"text": TEXT})
    before = sample["input_ids"].copy()
    sample["labels"][:] = IGNORE_INDEX
    assert np.array_equal(sample["input_ids"], before)


def test_plaintext_without_eos(tokenizer):
    """append_eos=False: the document is the text's tokens only."""
    document = tokenizer.encode(TEXT)
    (sample,) = PlaintextTransform(tokenizer, max_seq_len=4096, append_eos=False)({"text": TEXT})
    assert sample["input_ids"].tolist() == document[:-1]
    assert sample["labels"].tolist() == document[1:]
    assert tokenizer.eos_token_id not in sample["labels"].tolist()


@pytest.fixture
def tokenizer_without_eos() -> PreTrainedTokenizerFast:
    """The bundled vocabulary as a bare transformers tokenizer object: it names no EOS token."""
    return PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))


@pytest.mark.parametrize("build", ["class", "builder"])
def test_plaintext_with_append_eos_refuses_a_tokenizer_without_eos(tokenizer_without_eos, build):
    """As ``hp-data prepare`` refuses it: documents without an end token would run into each other. The error names
    the tokenizer, how to name its EOS and the setting that trains without one."""
    with pytest.raises(DataConfigError) as error:
        if build == "class":
            PlaintextTransform(tokenizer_without_eos, max_seq_len=64)
        else:
            build_llm_data_transform("plaintext", tokenizer_without_eos, max_seq_len=64, append_eos=True)
    message = str(error.value)
    assert "has no EOS token to append" in message
    assert "tokenizer.eos_token = '<|endoftext|>'" in message and "or set append_eos: false" in message

    (sample,) = PlaintextTransform(tokenizer_without_eos, max_seq_len=4096, append_eos=False)({"text": TEXT})
    assert sample["labels"][-1] != 0  # no EOS appended


def test_plaintext_text_template_renders_alpaca_records(tokenizer):
    """text_template is a str.format_map template over the record."""
    template = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
    record = {"instruction": "Name a colour.", "input": "", "output": "Blue.", "id": 3}
    (sample,) = PlaintextTransform(tokenizer, max_seq_len=4096, text_template=template)(record)
    text = "### Instruction:\nName a colour.\n\n### Input:\n\n\n### Response:\nBlue."
    document = tokenizer.encode(text) + [0]
    assert sample["input_ids"].tolist() == document[:-1]
    assert sample["labels"].tolist() == document[1:]


def test_plaintext_text_template_missing_field_names_it(tokenizer):
    """A template field the record lacks is a DataFileError naming the field, the record and its fields."""
    transform = PlaintextTransform(tokenizer, max_seq_len=8, text_template="{instruction}\n{output}")
    with pytest.raises(DataFileError) as raised:
        transform({"instruction": "Hi", "response": "Hello"}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "'output'", "['instruction', 'response']", "template"]:
        assert fragment in message


def test_plaintext_text_template_value_that_cannot_render_names_the_record(tokenizer):
    """A field value the template cannot format (here not subscriptable) is a DataFileError naming the record, not a
    bare TypeError, and ``on_invalid_record='skip'`` skips it."""
    template = "{title}: {meta[0]}"
    with pytest.raises(DataFileError) as raised:
        PlaintextTransform(tokenizer, max_seq_len=8, text_template=template)({"title": "t", "meta": None}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "TypeError", "'NoneType' object is not subscriptable", "['meta', 'title']", "template"]:
        assert fragment in message
    skipping = PlaintextTransform(tokenizer, max_seq_len=8, text_template=template, on_invalid_record="skip")
    assert skipping({"title": "t", "meta": None}, WHERE) == []


@pytest.mark.parametrize("template", ["no fields at all", "{}", "{0} and {1}", "{unclosed"])
def test_plaintext_bad_text_template_is_a_config_error(tokenizer, template):
    """A template that reads no named field, or is not a valid format string, fails at construction."""
    with pytest.raises(DataConfigError, match=r"text_template"):
        PlaintextTransform(tokenizer, max_seq_len=8, text_template=template)


def test_plaintext_text_keys_fall_back_in_order(tokenizer):
    """The first text key present with a non-null value is used."""
    transform = PlaintextTransform(tokenizer, max_seq_len=4096, text_keys=["content", "text"])
    expected = tokenizer.encode("second") + [0]
    for record in ({"text": "second"}, {"content": None, "text": "second"}, {"content": "second", "text": "other"}):
        (sample,) = transform(record)
        assert sample["input_ids"].tolist() + [int(sample["labels"][-1])] == expected


def test_plaintext_missing_text_keys_names_keys_tried_and_present(tokenizer):
    """No text key: DataFileError with the record, the keys tried, the keys present and the fix."""
    transform = PlaintextTransform(tokenizer, max_seq_len=8, text_keys=["content", "text"])
    with pytest.raises(DataFileError) as raised:
        transform({"body": "Hello", "text": None}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "['content', 'text']", "['body', 'text']", "Set text_keys"]:
        assert fragment in message


def test_plaintext_non_string_text_is_a_data_error(tokenizer):
    """A text field holding a list (e.g. a conversation) names the field and the type."""
    with pytest.raises(DataFileError, match=r"record 17 of /data/train\.jsonl: field 'text' holds list"):
        PlaintextTransform(tokenizer, max_seq_len=8)({"text": [{"role": "user"}]}, WHERE)


@pytest.mark.parametrize(("text", "append_eos"), [("", True), ("", False), ("a", False)])
def test_plaintext_too_short_document_errors_or_is_skipped(tokenizer, warnings_of_this_package, text, append_eos):
    """Fewer than 2 tokens make no pair: an error naming the record, or a warning and [] with 'skip'."""
    with pytest.raises(DataFileError, match=r"^record 17 of /data/train\.jsonl: the text has [01] token"):
        PlaintextTransform(tokenizer, max_seq_len=8, append_eos=append_eos)({"text": text}, WHERE)
    skipping = PlaintextTransform(tokenizer, max_seq_len=8, append_eos=append_eos, on_invalid_record="skip")
    assert skipping({"text": text}, WHERE) == []
    assert any(WHERE in r.getMessage() and r.levelno == logging.WARNING for r in warnings_of_this_package.records)


def test_plaintext_single_token_with_eos_is_one_pair(tokenizer):
    """One text token plus EOS is the shortest valid document: one pair (token -> EOS)."""
    (token,) = tokenizer.encode("a")
    (sample,) = PlaintextTransform(tokenizer, max_seq_len=8)({"text": "a"})
    assert sample["input_ids"].tolist() == [token] and sample["labels"].tolist() == [0]


@pytest.mark.parametrize("max_seq_len", [0, -4, None, True, 4.0, "4096"])
def test_plaintext_requires_a_positive_integer_max_seq_len(tokenizer, max_seq_len):
    with pytest.raises(DataConfigError, match=r"max_seq_len must be a positive integer"):
        PlaintextTransform(tokenizer, max_seq_len=max_seq_len)


@pytest.mark.parametrize("option", [{"on_invalid_record": "ignore"}, {"text_keys": []}, {"text_keys": ["a", 3]}])
def test_invalid_options_are_config_errors(tokenizer, option):
    with pytest.raises(DataConfigError):
        PlaintextTransform(tokenizer, max_seq_len=8, **option)
    with pytest.raises(DataConfigError):
        TextConversationTransform(tokenizer, chat_template="chatml", **option)


@pytest.mark.parametrize(
    ("data_type", "option", "named"),
    [
        ("plaintext", {"append_eos": "false"}, ["append_eos", "'false'", "true or false", "unquoted"]),
        ("plaintext", {"append_eos": 0}, ["append_eos", "0", "true or false"]),
        ("identity", {"labels_are_shifted": "no"}, ["labels_are_shifted", "'no'", "true or false"]),
        ("identity", {"input_ids_key": 5}, ["input_ids_key must be a non-empty field name", "5"]),
        ("identity", {"labels_key": ""}, ["labels_key must be a non-empty field name", "''"]),
        ("conversation", {"role_key": ""}, ["role_key must be a non-empty field name", "''"]),
        ("conversation", {"content_key": 3}, ["content_key must be a non-empty field name", "3"]),
    ],
)
def test_quoted_flags_and_field_names_of_other_types_are_refused(tokenizer, data_type, option, named):
    """A flag given as a string (``"false"`` would be true to Python) or a number, and a field name that is not a
    non-empty string, are ``DataConfigError``s naming the option and the value, never silently reinterpreted."""
    with pytest.raises(DataConfigError) as error:
        extra = {"chat_template": "chatml"} if data_type == "conversation" else {}
        build_llm_data_transform(data_type, tokenizer, max_seq_len=8, **extra, **option)
    for text in named:
        assert text in str(error.value)


def test_misspelt_options_and_data_types_suggest_the_closest_name(tokenizer):
    """An unknown option or data_type names the closest valid one."""
    with pytest.raises(DataConfigError, match=r"\['max_seq_length'\] .*did you mean 'max_seq_len'\?"):
        build_llm_data_transform("plaintext", tokenizer, max_seq_length=8)
    with pytest.raises(DataConfigError, match=r"unknown data_type 'plain' \(did you mean 'plaintext'\?\)"):
        build_llm_data_transform("plain", tokenizer, max_seq_len=8)


def test_non_mapping_record_is_a_data_error(tokenizer):
    with pytest.raises(DataFileError, match=r"^record 17 of /data/train\.jsonl: expected a record with named"):
        PlaintextTransform(tokenizer, max_seq_len=8)("just text", WHERE)


# -- conversation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat_template", ["tokenizer", "chatml"])
def test_conversation_sample_is_the_shifted_template_output(tokenizer, chat_template):
    """One ModelSample: the ChatML tokens without the last, labels shifted by one; each supervised span of
    labels decodes to one supervised message's content followed by <|im_end|> and a newline."""
    transform = TextConversationTransform(tokenizer, chat_template=chat_template)
    (sample,) = transform({"conversation": CONVERSATION}, WHERE)
    assert_model_sample(sample)
    full = tokenizer.encode(CHATML_TEXT)
    assert sample["input_ids"].tolist() == full[:-1]
    labels = sample["labels"]
    supervised = labels != IGNORE_INDEX
    assert np.array_equal(labels[supervised], np.asarray(full[1:])[supervised])  # each label is the next token
    spans = [tokenizer.decode(labels[a:b]) for a, b in supervised_spans(labels)]
    assert spans == [f"{CONVERSATION[i]['content']}{IM_END}\n" for i in SUPERVISED]


def test_conversation_with_other_templates_supervises_only_assistant_content(tokenizer):
    """llama2 and default: the supervised spans are the assistant turns with their end-of-turn tokens."""
    raw = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    (llama2,) = TextConversationTransform(tokenizer, chat_template="llama2")({"conversation": raw})
    assert [tokenizer.decode(llama2["labels"][a:b]) for a, b in supervised_spans(llama2["labels"])] == [
        f" Hello! {EOS}"
    ]
    (default,) = TextConversationTransform(tokenizer, chat_template="default")({"conversation": raw})
    assert tokenizer.decode(np.append(default["input_ids"], default["labels"][-1])) == (
        f"User: Hi there{EOS}\nAssistant: Hello!{EOS}\n"
    )
    assert [tokenizer.decode(default["labels"][a:b]) for a, b in supervised_spans(default["labels"])] == [
        f"Hello!{EOS}\n"
    ]


def test_conversation_accepts_a_chat_template_instance(tokenizer):
    template = ChatMLTemplate(tokenizer)
    transform = TextConversationTransform(tokenizer, chat_template=template)
    assert transform.chat_template is template


def test_a_chat_template_that_carries_its_tokenizer_needs_no_other(tokenizer, tokenizer_path):
    """A ChatTemplate given as chat_template, as the first argument (upstream hyper_parallel's order) or to
    build_llm_data_transform needs no tokenizer: every way gives the sample a tokenizer and a name give."""
    record = {"conversation": CONVERSATION}
    (reference,) = TextConversationTransform(tokenizer, chat_template="chatml")(record, WHERE)
    template = ChatMLTemplate(tokenizer_path)  # built from a path: the transform gets its tokenizer from it
    for transform in (
        TextConversationTransform(chat_template=template),
        TextConversationTransform(template, max_seq_len=64),
        build_llm_data_transform("conversation", chat_template=template, max_seq_len=64),
        build_llm_data_transform("conversation", template),
    ):
        assert transform.chat_template is template and transform.tokenizer is template.tokenizer
        (sample,) = transform(record, WHERE)
        for key in ("input_ids", "labels"):
            assert np.array_equal(sample[key], reference[key])
    with pytest.raises(DataConfigError, match=r"two chat templates given: .* chat_template='llama2'"):
        TextConversationTransform(template, chat_template="llama2")
    with pytest.raises(DataConfigError, match=r"two chat templates given"):
        TextConversationTransform(template, chat_template=ChatMLTemplate(tokenizer))


def test_conversation_supervise_role_header_trains_the_assistant_header(tokenizer):
    """supervise_role_header (a YAML key of the transform) supervises each supervised message whole, its
    <|im_start|>role header included, as upstream hyper_parallel does; the ids do not change."""
    record = {"conversation": CONVERSATION}
    (plain,) = build_llm_data_transform("conversation", tokenizer, chat_template="chatml")(record, WHERE)
    (headed,) = build_llm_data_transform("conversation", tokenizer, chat_template="chatml", supervise_role_header=True)(
        record, WHERE
    )
    assert np.array_equal(plain["input_ids"], headed["input_ids"])
    spans = [tokenizer.decode(headed["labels"][a:b]) for a, b in supervised_spans(headed["labels"])]
    # Messages 2 and 3 are adjacent, so their spans join.
    assert spans == [
        f"<|im_start|>assistant\n{CONVERSATION[2]['content']}{IM_END}\n"
        f"<|im_start|>user\n{CONVERSATION[3]['content']}{IM_END}\n",
        f"<|im_start|>assistant\n{CONVERSATION[7]['content']}{IM_END}\n",
    ]
    full = tokenizer.encode(CHATML_TEXT)
    supervised = headed["labels"] != IGNORE_INDEX
    assert np.array_equal(headed["labels"][supervised], np.asarray(full[1:])[supervised])
    headed_template = ChatMLTemplate(tokenizer, supervise_role_header=True)
    assert TextConversationTransform(chat_template=headed_template).chat_template.supervise_role_header
    with pytest.raises(DataConfigError, match=r"built with supervise_role_header=True"):
        TextConversationTransform(chat_template=headed_template, supervise_role_header=False)


def test_conversation_message_fields_reach_the_template(tokenizer):
    """Fields besides role and content (metadata, tool_calls...) reach the chat template's messages."""
    seen = []

    class Recording(ChatMLTemplate):
        def encode_messages(self, messages, where="record"):
            seen.extend(messages)
            return super().encode_messages(messages, where)

    raw = [
        {"from": "human", "value": "Hi", "metadata": {"source": "forum"}},
        {"from": "gpt", "value": "Hello!", "tool_calls": [{"name": "greet"}]},
    ]
    transform = TextConversationTransform(Recording(tokenizer), role_key="from", content_key="value")
    transform({"conversation": raw}, WHERE)
    assert seen == [
        {"role": "user", "content": "Hi", "metadata": {"source": "forum"}},
        {"role": "assistant", "content": "Hello!", "tool_calls": [{"name": "greet"}]},
    ]


def test_conversation_text_keys_fallbacks_and_sharegpt_fields(tokenizer):
    """text_keys lists fallbacks; role_key/content_key read ShareGPT's from/value; role_map renames roles."""
    transform = TextConversationTransform(
        tokenizer,
        chat_template="chatml",
        text_keys=["conversation", "messages"],
        role_key="from",
        content_key="value",
        role_map={"narrator": "system"},
    )
    record = {
        "conversation": None,
        "messages": [
            {"from": "narrator", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ],
    }
    (sample,) = transform(record)
    text = (
        f"<|im_start|>system\nBe brief.{IM_END}\n<|im_start|>user\nHi{IM_END}\n<|im_start|>assistant\nHello!{IM_END}\n"
    )
    assert sample["input_ids"].tolist() == tokenizer.encode(text)[:-1]
    spans = [tokenizer.decode(sample["labels"][a:b]) for a, b in supervised_spans(sample["labels"])]
    assert spans == [f"Hello!{IM_END}\n"]


def test_sharegpt_records_need_no_role_or_content_key(tokenizer):
    """``{"conversations": [{"from", "value"}, ...]}`` trains as the same conversation written with role/content."""
    transform = build_llm_data_transform("conversation", tokenizer, chat_template="chatml", text_keys="conversations")
    sharegpt = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ]
    openai = [{"role": m["from"], "content": m["value"]} for m in sharegpt]
    (sample,) = transform({"conversations": sharegpt}, WHERE)
    (expected,) = transform({"conversations": openai}, WHERE)
    text = (
        f"<|im_start|>system\nBe brief.{IM_END}\n<|im_start|>user\nHi{IM_END}\n<|im_start|>assistant\nHello!{IM_END}\n"
    )
    assert sample["input_ids"].tolist() == expected["input_ids"].tolist() == tokenizer.encode(text)[:-1]
    assert sample["labels"].tolist() == expected["labels"].tolist()
    assert tokenizer.decode(sample["labels"][sample["labels"] != IGNORE_INDEX].tolist()) == f"Hello!{IM_END}\n"


def test_sharegpt_role_map_maps_dataset_roles_and_names_a_role_it_does_not_cover(tokenizer):
    transform = TextConversationTransform(
        tokenizer, chat_template="chatml", text_keys="conversations", role_map={"customer": "user", "agent": "gpt"}
    )
    (sample,) = transform({"conversations": [{"from": "customer", "value": "Hi"}, {"from": "agent", "value": "Yes?"}]})
    assert tokenizer.decode(sample["input_ids"].tolist()).startswith("<|im_start|>user\nHi")
    with pytest.raises(DataFileError) as raised:
        transform({"conversations": [{"from": "customer", "value": "Hi"}, {"from": "clerk", "value": "Yes?"}]}, WHERE)
    for fragment in [
        WHERE,
        "field 'conversations'",
        "message 1",
        "unknown role 'clerk'",
        "does not cover it",
        "role_map",
    ]:
        assert fragment in str(raised.value)


def test_conversation_is_never_truncated(tokenizer):
    """max_seq_len is exposed for the loader but a longer conversation is returned whole."""
    transform = TextConversationTransform(tokenizer, chat_template="chatml", max_seq_len=8)
    assert transform.max_seq_len == 8
    (sample,) = transform({"conversation": CONVERSATION})
    assert len(sample["input_ids"]) == len(tokenizer.encode(CHATML_TEXT)) - 1 > 8


@pytest.mark.parametrize(
    "raw",
    [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "loss_mask": False}],
    ],
)
def test_conversation_without_supervised_tokens_errors_or_is_skipped(tokenizer, warnings_of_this_package, raw):
    """No supervised token: a DataFileError naming the record and the fix, or with 'skip' a warning and []."""
    transform = TextConversationTransform(tokenizer, chat_template="chatml")
    with pytest.raises(DataFileError) as raised:
        transform({"conversation": raw}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "no message", "supervised", "assistant turn", "loss_mask"]:
        assert fragment in message
    skipping = TextConversationTransform(tokenizer, chat_template="chatml", on_invalid_record="skip")
    assert skipping({"conversation": raw}, WHERE) == []
    warnings = [r.getMessage() for r in warnings_of_this_package.records if r.levelno == logging.WARNING]
    assert any(WHERE in w and "supervised" in w for w in warnings)


def test_conversation_malformed_messages_name_record_field_and_message(tokenizer, warnings_of_this_package):
    """Message errors name the record, the conversation field and the message; 'skip' skips them too."""
    raw = [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Once"}]
    transform = TextConversationTransform(tokenizer, chat_template="chatml", text_keys=["messages"])
    with pytest.raises(DataFileError) as raised:
        transform({"messages": raw}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "field 'messages'", "message 1", "unknown role 'narrator'", "role_map"]:
        assert fragment in message
    skipping = TextConversationTransform(
        tokenizer, chat_template="chatml", text_keys="messages", on_invalid_record="skip"
    )
    assert skipping({"messages": raw}, WHERE) == []
    assert any(WHERE in r.getMessage() for r in warnings_of_this_package.records)


def test_conversation_missing_field_names_keys(tokenizer):
    transform = TextConversationTransform(tokenizer, chat_template="chatml", text_keys=["conversation", "messages"])
    with pytest.raises(DataFileError) as raised:
        transform({"text": "Hello"}, WHERE)
    message = str(raised.value)
    for fragment in [WHERE, "no conversation field", "['conversation', 'messages']", "['text']"]:
        assert fragment in message


def test_conversation_role_map_must_map_to_roles(tokenizer):
    with pytest.raises(DataConfigError, match=r"role_map entry 'narrator': 'storyteller' is invalid"):
        TextConversationTransform(tokenizer, chat_template="chatml", role_map={"narrator": "storyteller"})


def test_conversation_template_errors_are_not_skipped(tokenizer):
    """A template that cannot be rendered incrementally is a configuration problem: 'skip' does not hide it."""
    from hyper_parallel.data.text.chat_template import TokenizerChatTemplate

    template = TokenizerChatTemplate(tokenizer, template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    transform = TextConversationTransform(tokenizer, chat_template=template, on_invalid_record="skip")
    raw = [{"role": "user", "content": "The capital of Fr"}, {"role": "assistant", "content": "ance is Paris."}]
    with pytest.raises(DataConfigError, match=r"prefix"):
        transform({"conversation": raw}, WHERE)


# -- identity -------------------------------------------------------------------------------------------------------


def test_identity_shifts_pre_tokenized_records():
    """Labels default to the input_ids; both are shifted by one unless labels_are_shifted."""
    transform = IdentityDataTransform()
    (sample,) = transform({"input_ids": [5, 6, 7, 8]})
    assert_model_sample(sample)
    assert sample["input_ids"].tolist() == [5, 6, 7] and sample["labels"].tolist() == [6, 7, 8]
    (masked,) = transform({"input_ids": np.array([5, 6, 7, 8], np.int32), "labels": [-100, -100, 7, 8]})
    assert masked["input_ids"].tolist() == [5, 6, 7] and masked["labels"].tolist() == [-100, 7, 8]
    assert masked["input_ids"].dtype == np.int64


def test_identity_with_shifted_labels_and_custom_keys():
    transform = IdentityDataTransform(input_ids_key="tokens", labels_key="targets", labels_are_shifted=True)
    (sample,) = transform({"tokens": [5, 6, 7], "targets": [6, 7, -100]})
    assert sample["input_ids"].tolist() == [5, 6, 7] and sample["labels"].tolist() == [6, 7, -100]
    (single,) = transform({"tokens": [5], "targets": [6]})
    assert single["input_ids"].tolist() == [5] and single["labels"].tolist() == [6]


def test_identity_output_does_not_alias_the_record():
    record = {"input_ids": np.array([1, 2, 3], np.int64)}
    (sample,) = IdentityDataTransform()(record)
    sample["input_ids"][:] = 0
    sample["labels"][:] = 0
    assert record["input_ids"].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        ({"tokens": [1, 2]}, "no 'input_ids' field; the record has fields ['tokens']"),
        ({"input_ids": "1 2 3"}, "field 'input_ids' must be a flat list of integer token ids, got str"),
        ({"input_ids": [[1, 2], [3, 4]]}, "must be a flat list of integer token ids, got int64 array of shape (2, 2)"),
        ({"input_ids": [1.0, 2.0]}, "must be a flat list of integer token ids, got float64"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "'labels' has 2 entries but 'input_ids' has 3"),
        ({"input_ids": [1, -2, 3]}, "negative id -2"),
        ({"input_ids": [1, 2, 3], "labels": [1, -5, 3]}, "field 'labels' holds -5"),
        ({"input_ids": [1]}, "too short"),
        ({"input_ids": []}, "too short"),
        ({"input_ids": [1, 2, 3], "labels": [1, -100, -100]}, "every label is -100"),
    ],
)
def test_identity_invalid_records_are_data_errors(record, fragment):
    with pytest.raises(DataFileError) as raised:
        IdentityDataTransform()(record, WHERE)
    assert str(raised.value).startswith(WHERE + ":")
    assert fragment in str(raised.value)
    assert IdentityDataTransform(on_invalid_record="skip")(record, WHERE) == []


# -- build_llm_data_transform ---------------------------------------------------------------------------------------


def test_builder_makes_each_data_type(tokenizer, tokenizer_path):
    """plaintext/conversation/identity (instruction: its own tests); a tokenizer path is loaded; the YAML example
    builds as written."""
    assert set(DATA_TRANSFORM_REGISTRY) == {"plaintext", "conversation", "instruction", "identity"}
    yaml_node = {"data_type": "plaintext", "text_keys": "text", "max_seq_len": 4096}
    plaintext = build_llm_data_transform(tokenizer=tokenizer_path, **yaml_node)
    assert isinstance(plaintext, PlaintextTransform) and plaintext.max_seq_len == 4096
    (sample,) = plaintext({"text": TEXT})
    assert sample["input_ids"].tolist() == tokenizer.encode(TEXT)
    conversation = build_llm_data_transform("conversation", tokenizer, chat_template="chatml", max_seq_len=2048)
    assert isinstance(conversation, TextConversationTransform) and conversation.max_seq_len == 2048
    identity = build_llm_data_transform("identity", max_seq_len=16)
    assert isinstance(identity, IdentityDataTransform) and identity.max_seq_len == 16
    assert isinstance(build_llm_data_transform("identity", tokenizer), IdentityDataTransform)


@pytest.mark.parametrize("labels_are_shifted", [False, True])
@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_identity_refuses_ids_past_the_tokenizer_vocabulary(tokenizer, labels_are_shifted, field):
    """With the pipeline's tokenizer, an id or label of ``vocab_size`` or more is an error naming the record, the
    field, the id and its position; ``vocab_size - 1`` is a token."""
    transform = build_llm_data_transform("identity", tokenizer, labels_are_shifted=labels_are_shifted)
    record = {"input_ids": [5, 8191, 7, 9], "labels": [8191, 7, 9, IGNORE_INDEX]}
    (sample,) = transform(record, WHERE)
    assert 8191 in sample["input_ids"].tolist() + sample["labels"].tolist()

    for bad in (8192, 10**6):
        record[field] = [5, 6, bad, IGNORE_INDEX if field == "labels" else 9]
        with pytest.raises(DataFileError) as error:
            transform(record, WHERE)
        assert str(error.value).startswith(
            f"{WHERE}: field '{field}' holds the id {bad} at position 2, outside the vocabulary [0, 8192) of "
            f"tokenizer {tokenizer.name_or_path}"
        )


def test_identity_with_a_tokenizer_still_refuses_negative_ids_and_skips_when_asked(tokenizer):
    transform = build_llm_data_transform("identity", tokenizer, on_invalid_record="skip")
    assert transform({"input_ids": [5, 9000, 7]}, WHERE) == []
    assert IdentityDataTransform(tokenizer).vocab_size == 8192


def test_builder_errors(tokenizer):
    with pytest.raises(
        DataConfigError, match=r"unknown data_type 'sft'; use one of plaintext, conversation, instruction, identity"
    ):
        build_llm_data_transform("sft", tokenizer)
    for data_type in ("plaintext", "conversation", "instruction"):
        with pytest.raises(DataConfigError, match=rf"data_type '{data_type}' needs a tokenizer"):
            build_llm_data_transform(data_type, max_seq_len=8)
    with pytest.raises(DataConfigError, match=r"unknown option\(s\) \['text_key'\] for data_type 'plaintext'"):
        build_llm_data_transform("plaintext", tokenizer, text_key="text", max_seq_len=8)
    with pytest.raises(DataConfigError, match=r"requires the option\(s\) \['max_seq_len'\]"):
        build_llm_data_transform("plaintext", tokenizer)
    with pytest.raises(DataConfigError, match=r"unknown chat_template 'chatml2'"):
        build_llm_data_transform("conversation", tokenizer, chat_template="chatml2")
    with pytest.raises(DataConfigError, match=r"tokenizer must be a TextTokenizer"):
        build_llm_data_transform("plaintext", object(), max_seq_len=8)


# -- pickling -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_type", "options", "record"),
    [
        ("plaintext", {"max_seq_len": 16, "text_keys": ["body", "text"]}, {"text": TEXT}),
        ("conversation", {"chat_template": "tokenizer"}, {"conversation": CONVERSATION}),
        ("conversation", {"chat_template": "llama2", "on_invalid_record": "skip"}, {"conversation": CONVERSATION}),
        ("identity", {"labels_are_shifted": True}, {"input_ids": [3, 4, 5], "labels": [4, 5, -100]}),
    ],
)
def test_transforms_pickle_round_trip(tokenizer, data_type, options, record):
    """Transforms travel to data-loader workers: the copy has the same settings and gives the same samples."""
    transform = build_llm_data_transform(data_type, tokenizer, **options)
    expected = transform(record, WHERE)
    assert expected
    copy = pickle.loads(pickle.dumps(transform))
    assert copy.max_seq_len == transform.max_seq_len
    assert copy.on_invalid_record == transform.on_invalid_record
    got = copy(record, WHERE)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])


@pytest.mark.parametrize("on_invalid_record", ["skip", "error"])
def test_plaintext_batches_give_the_same_samples_as_one_record_at_a_time(tokenizer, on_invalid_record):
    transform = PlaintextTransform(tokenizer, max_seq_len=7, on_invalid_record=on_invalid_record)
    records = [
        {"text": "It is a truth universally acknowledged."},
        {"text": ""},
        {"title": "no text"},
        {"text": "Yes."},
    ]
    records += [{"text": " ".join(["word"] * n)} for n in (1, 9, 30)]
    wheres = [f"record {i}" for i in range(len(records))]
    if on_invalid_record == "error":
        with pytest.raises(DataFileError, match="record 1"):
            transform.batch(records, wheres)
        records, wheres = records[:1] + records[3:], wheres[:1] + wheres[3:]
    batched = transform.batch(records, wheres)
    single = [transform(record, where) for record, where in zip(records, wheres, strict=True)]
    assert [[{k: v.tolist() for k, v in s.items()} for s in samples] for samples in batched] == [
        [{k: v.tolist() for k, v in s.items()} for s in samples] for samples in single
    ]
    assert any(len(samples) > 1 for samples in batched)
