"""Specification of SFT data prepared offline beyond conversations: instruction records (``instruction_key``) give
the tokens and loss mask the Online ``InstructionTransform`` gives the same record, and ``pack_to_seq_len`` packs a
chat template's loss mask into the same records as its tokens, so the Indexed path reads the packed pair with the
targets of the unpacked one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.indexed_pretrain_dataset import GPTDataset, GPTFromMRDataset
from hyper_parallel.data.text.build_data_transform import build_llm_data_transform
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import main, run_offline_preparation

INSTRUCTIONS = [
    {"instruction": "Name the heroine of Emma.", "output": "Emma Woodhouse."},
    {"instruction": "Translate into French.", "input": "Good morning, Mr. Knightley.", "output": "Bonjour."},
    {"instruction": "Who wrote Persuasion?", "input": "", "output": "Jane Austen, published in 1817."},
    {"instruction": "Summarise the sentence.", "input": None, "output": "A rich man needs a wife."},
]
CONVERSATIONS = [
    [{"role": "user", "content": "Who wrote Emma?"}, {"role": "assistant", "content": "Jane Austen wrote Emma."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where does Mr. Darcy live?"},
        {"role": "assistant", "content": "At Pemberley.", "loss_mask": False},
        {"role": "user", "content": "And Mr. Knightley?"},
        {"role": "assistant", "content": "At Donwell Abbey, in Surrey."},
    ],
    [{"role": "user", "content": "Name a sister of Elizabeth."}, {"role": "assistant", "content": "Jane."}],
    [{"role": "user", "content": "How does it begin?"}, {"role": "assistant", "content": "It is a truth."}],
    [{"role": "user", "content": "Who is Mr. Collins?"}, {"role": "assistant", "content": "A clergyman."}],
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return str(path)


def prepare(directory, tokenizer_path, records, **options):
    """Prepare ``records`` (one worker, chatml unless told otherwise); returns the summary and the tokens' prefix."""
    directory.mkdir(exist_ok=True)
    key = options.pop("key", "text")
    config = OfflinePreparationConfig(
        dataset_name_or_path=write_jsonl(directory / "records.jsonl", records),
        output_prefix=str(directory / "sft"),
        tokenizer_name_or_path=str(tokenizer_path),
        json_keys=(key,),
        workers=1,
        **{"chat_template": "chatml", **options},
    )
    return run_offline_preparation(config), str(directory / f"sft_{key}_document")


def pair_documents(prefix) -> tuple[list[list[int]], list[list[int]]]:
    tokens, mask = IndexedDataReader(prefix), IndexedDataReader(f"{prefix}_loss_mask")
    assert mask.dtype == np.uint8 and mask.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
    return [tokens[i].tolist() for i in range(len(tokens))], [mask[i].tolist() for i in range(len(mask))]


# -- instruction records --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat_template", ["chatml", "tokenizer"])
def test_instruction_records_are_the_online_instruction_samples_token_for_token(
    tmp_path, tokenizer_path, chat_template
):
    """Document d, shifted, is the Online sample: its tokens are the inputs, its mask marks the labels."""
    online = build_llm_data_transform("instruction", tokenizer_path, chat_template=chat_template)
    samples = [online(record)[0] for record in INSTRUCTIONS]
    _, prefix = prepare(
        tmp_path, tokenizer_path, INSTRUCTIONS, chat_template=chat_template, instruction_key="instruction"
    )
    tokens, mask = pair_documents(prefix)
    assert len(tokens) == len(INSTRUCTIONS)
    for document, sample in enumerate(samples):
        assert tokens[document][-1] == 0 and mask[document][-1] == 0  # the appended EOD (0) is never a target
        ids, supervised = np.array(tokens[document][:-1]), np.array(mask[document][:-1])
        assert ids[:-1].tolist() == sample["input_ids"].tolist()
        labels = np.where(supervised[1:] == 1, ids[1:], IGNORE_INDEX)
        assert labels.tolist() == sample["labels"].tolist()


def test_other_field_names_are_read_and_the_output_is_named_by_the_json_key(tmp_path, tokenizer_path):
    records = [{"question": r["instruction"], "context": r.get("input"), "answer": r["output"]} for r in INSTRUCTIONS]
    names = {"instruction_key": "question", "input_key": "context", "output_key": "answer"}
    summary, prefix = prepare(tmp_path / "renamed", tokenizer_path, records, key="alpaca", **names)
    assert summary.outputs == {"alpaca": prefix, "alpaca_loss_mask": f"{prefix}_loss_mask"}
    _, reference = prepare(tmp_path / "default", tokenizer_path, INSTRUCTIONS, instruction_key="instruction")
    assert pair_documents(prefix) == pair_documents(reference)


def test_the_input_follows_the_instruction_after_a_blank_line_and_only_the_answer_is_a_target(tmp_path, tokenizer_path):
    tokenizer = build_llm_data_transform("instruction", tokenizer_path, chat_template="chatml").tokenizer
    _, prefix = prepare(tmp_path, tokenizer_path, INSTRUCTIONS[1:2], instruction_key="instruction", append_eod=False)
    (tokens,), (mask,) = pair_documents(prefix)
    prompt = (
        "<|im_start|>user\nTranslate into French.\n\nGood morning, Mr. Knightley.<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = "Bonjour.<|im_end|>\n"
    assert tokens == tokenizer.encode(prompt) + tokenizer.encode(answer)
    assert mask == [0] * len(tokenizer.encode(prompt)) + [1] * len(tokenizer.encode(answer))


@pytest.mark.parametrize(
    ("record", "field", "option"),
    [
        ({"input": "x", "output": "Blue."}, "'instruction'", "instruction_key"),
        ({"instruction": "Name a colour.", "output": None}, "'output'", "output_key"),
        ({"instruction": "Name a colour.", "output": ["Blue."]}, "'output' holds list", "output_key"),
    ],
)
def test_a_record_without_its_instruction_or_answer_names_the_line_the_field_and_the_fix(
    tmp_path, tokenizer_path, record, field, option
):
    records = [INSTRUCTIONS[0], record, INSTRUCTIONS[2]]
    with pytest.raises(DataFileError) as raised:
        prepare(tmp_path, tokenizer_path, records, instruction_key="instruction")
    for fragment in ["records.jsonl:line 2", field, option, "--skip-bad-records"]:
        assert fragment in str(raised.value)
    assert "on_invalid_record" not in str(raised.value)  # an Online option, not one of this command
    summary, prefix = prepare(tmp_path, tokenizer_path, records, instruction_key="instruction", skip_bad_records=True)
    assert (summary.bad_records, summary.documents) == (1, 2)
    assert len(IndexedDataReader(f"{prefix}_loss_mask")) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chat_template": None, "instruction_key": "instruction"}, "instruction_key .* needs --chat-template"),
        ({"output_key": "answer"}, "output_key names a field of instruction records; set instruction_key"),
        ({"chat_template": None, "input_key": "context"}, "input_key names a field of instruction records"),
        ({"instruction_key": "q", "role_map": {"human": "user"}}, "instruction records have fixed roles"),
        ({"instruction_key": "q", "output_key": "q"}, "three different fields"),
        ({"instruction_key": "q", "input_key": ""}, "must be field names"),
        ({"instruction_key": "q", "json_keys": ("a", "b")}, "exactly one json key \\(which names the output\\)"),
    ],
)
def test_instruction_settings_that_do_not_fit_are_refused(tmp_path, options, message):
    settings = {"chat_template": "chatml", **options}
    with pytest.raises(DataConfigError, match=message):
        OfflinePreparationConfig(
            dataset_name_or_path="x.jsonl", output_prefix=str(tmp_path / "p"), tokenizer_name_or_path="t", **settings
        )


def test_the_command_line_prepares_instruction_records(tmp_path, tokenizer_path, restore_package_logger, capsys):
    records = [{"prompt": "Name a colour.", "response": "Blue."}]
    flags = ["--dataset-name-or-path", write_jsonl(tmp_path / "alpaca.jsonl", records)]
    flags += ["--output-prefix", str(tmp_path / "cli"), "--tokenizer-name-or-path", str(tokenizer_path)]
    flags += ["--chat-template", "chatml", "--instruction-key", "prompt", "--output-key", "response"]
    assert main([*flags, "--workers", "1"]) == 0
    assert "output [text_loss_mask]" in capsys.readouterr().out
    assert sum(IndexedDataReader(tmp_path / "cli_text_document_loss_mask")[0].tolist()) > 0
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--instruction-key FIELD" in capsys.readouterr().out


# -- a chat template with pack_to_seq_len ---------------------------------------------------------------------------


def packed_and_unpacked(tmp_path, tokenizer_path, seq_len, **options):
    """The packed tokens and mask records, and the unpacked documents concatenated, of the same conversations."""
    prepared = {}
    for name, pack in (("unpacked", None), ("packed", seq_len)):
        summary, prefix = prepare(
            tmp_path / name, tokenizer_path, [{"messages": c} for c in CONVERSATIONS], key="messages",
            pack_to_seq_len=pack, **options,
        )  # fmt: skip
        prepared[name] = (summary, prefix, *pair_documents(prefix))
    return prepared["packed"], prepared["unpacked"]


@pytest.mark.parametrize("append_eod", [True, False])
def test_packing_cuts_the_loss_mask_at_the_records_of_its_tokens(tmp_path, tokenizer_path, append_eod):
    seq_len = 15
    (summary, _, tokens, mask), (_, _, documents, masks) = packed_and_unpacked(
        tmp_path, tokenizer_path, seq_len, append_eod=append_eod
    )
    stream, mask_stream = sum(documents, []), sum(masks, [])
    records = len(stream) // (seq_len + 1)
    assert records >= 4 and len(stream) % (seq_len + 1)  # several records and a tail to drop
    assert [len(r) for r in tokens] == [len(r) for r in mask] == [seq_len + 1] * records
    assert sum(tokens, []) == stream[: records * (seq_len + 1)]
    assert sum(mask, []) == mask_stream[: records * (seq_len + 1)]
    # the tail is dropped once per pair, and counted once: the mask's entries are those of the same tokens
    assert summary.dropped_tail_tokens == len(stream) - records * (seq_len + 1)
    assert (summary.documents, summary.tokens) == (records, records * (seq_len + 1))


def test_partitions_pack_each_conversations_mask_with_its_tokens(tmp_path, tokenizer_path):
    """Each of two partitions packs its own records (0, 2, 4 and 1, 3: the first three and the last two documents
    of the unpacked run with two partitions) and drops its own tail."""
    seq_len = 11
    (summary, _, tokens, mask), (_, _, documents, masks) = packed_and_unpacked(
        tmp_path, tokenizer_path, seq_len, partitions=2
    )
    expected_tokens, expected_mask, dropped = [], [], 0
    for part in (slice(0, 3), slice(3, 5)):
        stream, mask_stream = sum(documents[part], []), sum(masks[part], [])
        used = len(stream) // (seq_len + 1) * (seq_len + 1)
        expected_tokens += [stream[i : i + seq_len + 1] for i in range(0, used, seq_len + 1)]
        expected_mask += [mask_stream[i : i + seq_len + 1] for i in range(0, used, seq_len + 1)]
        dropped += len(stream) - used
    assert (tokens, mask, summary.dropped_tail_tokens) == (expected_tokens, expected_mask, dropped)


def expected_labels(stream: list[int], mask_stream: list[int], start: int, seq_length: int) -> list[int]:
    """The labels of the sample of tokens ``stream[start : start + seq_length]``: each next token where its mask is
    1, else IGNORE_INDEX."""
    window = range(start + 1, start + seq_length + 1)
    return [stream[i] if mask_stream[i] else IGNORE_INDEX for i in window]


def test_gpt_dataset_over_the_packed_pair_trains_exactly_where_the_unpacked_mask_is_one(tmp_path, tokenizer_path):
    """Samples of 10 tokens cut across the packed records of 16 (records of another length than seq_length + 1 are
    read as documents, in megatron-core's shuffled order: its sample index says where each sample lies)."""
    (_, prefix, tokens, mask), _ = packed_and_unpacked(tmp_path, tokenizer_path, 15)
    seq_len = 10
    config = {"seq_length": seq_len, "split": "1, 0, 0", "read_loss_mask": "required"}
    dataset = build_indexed_text_dataset(prefix, config, None, tokenizer_path)[0]
    assert isinstance(dataset, GPTDataset) and len(dataset) == (sum(map(len, tokens)) - 1) // seq_len
    supervised = 0
    for index in range(len(dataset)):
        position = dataset.shuffle_index[index]
        (first, offset), (last, end) = dataset.sample_index[position : position + 2].tolist()
        records = dataset.document_index[first : last + 1].tolist()
        stream, mask_stream = sum((tokens[r] for r in records), []), sum((mask[r] for r in records), [])
        start, stop = offset, len(stream) - len(tokens[records[-1]]) + end + 1
        sample = dataset[index]
        assert sample["tokens"].tolist() == stream[start : stop - 1]
        assert sample["labels"].tolist() == expected_labels(stream, mask_stream, start, seq_len)
        assert sample["loss_mask"].tolist() == [float(label != IGNORE_INDEX) for label in sample["labels"].tolist()]
        supervised += int(sample["loss_mask"].sum())
    assert 0 < supervised < len(dataset) * seq_len


def test_packed_records_read_as_they_are_keep_their_mask(tmp_path, tokenizer_path):
    """``is_dataset_from_mr``: record r is sample r, its labels IGNORE_INDEX where the record's mask is 0."""
    seq_len = 15
    (_, prefix, tokens, mask), _ = packed_and_unpacked(tmp_path, tokenizer_path, seq_len)
    config = {"seq_length": seq_len, "split": "1, 0, 0", "is_dataset_from_mr": True, "read_loss_mask": "required"}
    dataset = build_indexed_text_dataset(prefix, config, None, tokenizer_path)[0]
    assert isinstance(dataset, GPTFromMRDataset) and len(dataset) == len(tokens)
    samples = dataset.__getitems__(list(range(len(dataset))))
    for record, sample in zip(range(len(tokens)), samples, strict=True):
        assert sample["tokens"].tolist() == tokens[record][:-1]
        assert sample["labels"].tolist() == expected_labels(tokens[record], mask[record], 0, seq_len)
    assert dataset[1]["labels"].tolist() == samples[1]["labels"].tolist()
    unmasked = build_indexed_text_dataset(prefix, {**config, "read_loss_mask": "off"}, None, tokenizer_path)[0]
    assert unmasked[0]["labels"].tolist() == tokens[0][1:]
