"""Specification of the instruction transform (``data_type: instruction``): an Alpaca-style record
``{"instruction", "input", "output"}`` is the conversation ``user: instruction [+ input], assistant: output``
through a chat template, with only the answer supervised. Expected tokens come from encoding hand-written ChatML
text with the bundled tokenizer.
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.build_data_transform import (
    DATA_TRANSFORM_REGISTRY,
    InstructionTransform,
    TextConversationTransform,
    build_llm_data_transform,
)
from hyper_parallel.data.text.chat_template import build_chat_template

IM_END = "<|im_end|>"
WHERE = "line 3 of /data/instructions.jsonl"
RECORD = {
    "instruction": "Name the heroine of Pride and Prejudice.",
    "input": "Answer with her full name.",
    "output": "Elizabeth Bennet.",
}


def chatml(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}{IM_END}\n<|im_start|>assistant\n{assistant}{IM_END}\n"


def supervised_text(tokenizer, labels: np.ndarray) -> str:
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())


@pytest.mark.parametrize("chat_template", ["chatml", "tokenizer"])
def test_instruction_and_input_are_the_user_turn_and_only_the_output_is_supervised(tokenizer, chat_template):
    transform = build_llm_data_transform(
        "instruction", tokenizer=tokenizer, chat_template=chat_template, max_seq_len=256
    )
    (sample,) = transform(RECORD, WHERE)
    ids = tokenizer.encode(chatml(f"{RECORD['instruction']}\n\n{RECORD['input']}", RECORD["output"]))
    assert sample["input_ids"].tolist() == ids[:-1]
    assert sample["labels"].dtype == np.int64 and len(sample["labels"]) == len(ids) - 1
    assert supervised_text(tokenizer, sample["labels"]) == f"{RECORD['output']}{IM_END}\n"
    supervised = np.flatnonzero(sample["labels"] != IGNORE_INDEX)
    assert supervised.tolist() == list(range(supervised[0], len(ids) - 1))  # one span, to the end
    assert (sample["labels"][supervised] == np.asarray(ids)[supervised + 1]).all()  # next-token targets


@pytest.mark.parametrize("extra", [{}, {"input": None}, {"input": ""}])
def test_a_missing_null_or_empty_input_leaves_the_instruction_alone(tokenizer, extra):
    transform = InstructionTransform(tokenizer, chat_template="chatml")
    (sample,) = transform({"instruction": "Say hello.", "output": "Hello.", **extra})
    assert sample["input_ids"].tolist() == tokenizer.encode(chatml("Say hello.", "Hello."))[:-1]


def test_the_instruction_is_the_same_sample_as_the_conversation_it_stands_for(tokenizer):
    """The instruction transform is the conversation transform over the two turns it builds."""
    template = build_chat_template("chatml", tokenizer, supervise_role_header=True)
    conversation = TextConversationTransform(chat_template=template, text_keys="messages")
    instruction = InstructionTransform(chat_template=template)
    messages = [
        {"role": "user", "content": f"{RECORD['instruction']}\n\n{RECORD['input']}"},
        {"role": "assistant", "content": RECORD["output"]},
    ]
    (expected,) = conversation({"messages": messages})
    (sample,) = instruction(RECORD)
    for field in ("input_ids", "labels"):
        assert sample[field].tolist() == expected[field].tolist()


def test_field_names_are_configurable(tokenizer):
    transform = build_llm_data_transform(
        "instruction",
        tokenizer=tokenizer,
        chat_template="chatml",
        instruction_key="prompt",
        input_key="context",
        output_key="response",
    )
    (sample,) = transform({"prompt": "Q?", "context": "C.", "response": "A."})
    assert sample["input_ids"].tolist() == tokenizer.encode(chatml("Q?\n\nC.", "A."))[:-1]
    assert supervised_text(tokenizer, sample["labels"]) == f"A.{IM_END}\n"


@pytest.mark.parametrize(
    ("record", "fragments"),
    [
        ({"output": "A."}, ["no 'instruction' field", "['output']", "instruction_key"]),
        ({"instruction": "Q?", "output": None}, ["no 'output' field", "['instruction', 'output']", "output_key"]),
        ({"instruction": ["Q?"], "output": "A."}, ["field 'instruction' holds list", "expected a string"]),
        ({"instruction": "Q?", "input": 3, "output": "A."}, ["field 'input' holds int", "input_key"]),
    ],
)
def test_a_missing_or_malformed_field_names_the_record_the_field_and_the_fix(tokenizer, record, fragments):
    transform = InstructionTransform(tokenizer, chat_template="chatml")
    with pytest.raises(DataFileError) as raised:
        transform(record, WHERE)
    for fragment in [WHERE, *fragments]:
        assert fragment in str(raised.value)


def test_skip_warns_and_drops_an_invalid_record(tokenizer, caplog):
    transform = InstructionTransform(tokenizer, chat_template="chatml", on_invalid_record="skip")
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.data"):
        logging.getLogger("hyper_parallel.data").propagate = True
        assert transform({"instruction": "Q?"}, WHERE) == []
    assert any(WHERE in record.getMessage() and "'output'" in record.getMessage() for record in caplog.records)


def test_encode_gives_the_unshifted_labels_the_sample_is_shifted_from(tokenizer):
    transform = InstructionTransform(tokenizer, chat_template="chatml")
    ids, labels = transform.encode(RECORD)
    (sample,) = transform(RECORD)
    assert ids[:-1].tolist() == sample["input_ids"].tolist()
    assert labels[1:].tolist() == sample["labels"].tolist()
    assert labels[0] == IGNORE_INDEX


def test_invalid_options_are_config_errors(tokenizer):
    with pytest.raises(DataConfigError, match="output_key must be a non-empty field name"):
        InstructionTransform(tokenizer, chat_template="chatml", output_key="")
    with pytest.raises(DataConfigError, match=r"unknown option\(s\) \['text_keys'\] for data_type 'instruction'"):
        build_llm_data_transform("instruction", tokenizer=tokenizer, text_keys="messages")


def test_registered_and_picklable_with_a_repr_naming_its_fields(tokenizer):
    assert DATA_TRANSFORM_REGISTRY["instruction"] is InstructionTransform
    transform = InstructionTransform(tokenizer, chat_template="chatml", output_key="response")
    copy = pickle.loads(pickle.dumps(transform))
    record = {"instruction": "Q?", "response": "A."}
    assert copy(record)[0]["labels"].tolist() == transform(record)[0]["labels"].tolist()
    assert "output_key='response'" in repr(transform)
