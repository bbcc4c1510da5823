"""Specification of SFT data prepared once and read by the Indexed path: ``hp-data prepare --chat-template`` writes
a conversation key's tokens ``<prefix>_<key>_document`` and, as a second Megatron pair, its loss mask
``<prefix>_<key>_document_loss_mask`` (uint8 0/1 per token, the same documents of the same lengths); ``GPTDataset``
reads the mask over the same token ranges, so a sample trains exactly on the targets the Online conversation
transform trains on (same template, same tokenizer).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_config import parse_blend
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.indexed.io import IndexedDatasetBuilder
from hyper_parallel.data.indexed.pair_metadata import read_pair_metadata
from hyper_parallel.data.text.build_data_transform import build_llm_data_transform
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import main, run_offline_preparation

IM_END = "<|im_end|>"
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a literary assistant."},
        {"role": "user", "content": "Who wrote Emma?"},
        {"role": "assistant", "content": "Jane Austen wrote Emma."},
    ],
    [
        {"from": "human", "value": "Name a sister of Elizabeth Bennet."},
        {"from": "gpt", "value": "Jane."},
        {"from": "human", "value": "And another?"},
        {"from": "gpt", "value": "Lydia, the youngest."},
    ],
    [
        {"role": "user", "content": "Where does Mr. Darcy live?"},
        {"role": "assistant", "content": "At Pemberley, in Derbyshire.", "loss_mask": False},
        {"role": "user", "content": "And Mr. Knightley?"},
        {"role": "assistant", "content": "At Donwell Abbey."},
    ],
    [
        {"role": "user", "content": "How does Pride and Prejudice begin?"},
        {
            "role": "assistant",
            "content": "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife.",
        },
    ],
]


def write_conversations(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations), encoding="utf-8")
    return str(path)


def prepare(tmp_path, tokenizer_path, conversations=CONVERSATIONS, **options):
    tmp_path.mkdir(exist_ok=True)
    data = write_conversations(tmp_path / "chats.jsonl", conversations)
    config = OfflinePreparationConfig(
        dataset_name_or_path=data,
        output_prefix=str(tmp_path / "sft"),
        tokenizer_name_or_path=str(tokenizer_path),
        json_keys=("messages",),
        chat_template="chatml",
        workers=1,
        **{"append_eod": False, **options},
    )
    return run_offline_preparation(config), str(tmp_path / "sft_messages_document")


def online_samples(tokenizer_path, conversations=CONVERSATIONS) -> list[dict]:
    transform = build_llm_data_transform("conversation", tokenizer_path, chat_template="chatml", text_keys="messages")
    return [transform({"messages": conversation})[0] for conversation in conversations]


def train_split(prefix, tokenizer_path, seq_length, **settings):
    config = {"seq_length": seq_length, "split": "1, 0, 0", **settings}
    return build_indexed_text_dataset(prefix, config, None, tokenizer_path)[0]


# -- what preparation writes ----------------------------------------------------------------------------------------


def test_preparation_writes_the_tokens_and_a_uint8_loss_mask_pair_of_the_same_documents(tmp_path, tokenizer_path):
    summary, prefix = prepare(tmp_path, tokenizer_path)
    tokens, mask = IndexedDataReader(prefix), IndexedDataReader(f"{prefix}_loss_mask")
    assert mask.dtype == np.uint8 and len(mask) == len(tokens) == len(CONVERSATIONS)
    assert mask.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
    assert mask.document_indices.tolist() == tokens.document_indices.tolist()
    assert summary.documents == len(CONVERSATIONS) and summary.tokens == tokens.num_tokens
    assert summary.outputs == {"messages": prefix, "messages_loss_mask": f"{prefix}_loss_mask"}
    metadata = read_pair_metadata(f"{prefix}_loss_mask")
    assert (metadata.token_dtype, metadata.vocab_size, metadata.eod_id) == ("uint8", 2, None)

    # The first conversation, written out in ChatML by hand: only the answer and its end of turn are 1.
    tokenizer = build_llm_data_transform("conversation", tokenizer_path, chat_template="chatml").tokenizer
    header = "<|im_start|>system\nYou are a literary assistant.<|im_end|>\n<|im_start|>user\nWho wrote Emma?"
    header += "<|im_end|>\n<|im_start|>assistant\n"
    answer = f"Jane Austen wrote Emma.{IM_END}\n"
    assert tokens[0].tolist() == tokenizer.encode(header) + tokenizer.encode(answer)
    assert mask[0].tolist() == [0] * len(tokenizer.encode(header)) + [1] * len(tokenizer.encode(answer))
    assert set(np.concatenate(mask[0 : len(mask)]).tolist()) == {0, 1}


def test_partitions_keep_each_conversations_mask_with_its_tokens(tmp_path, tokenizer_path):
    """Round-robin partitions merge the records in another order, each document's mask still beside its tokens."""
    _, whole = prepare(tmp_path / "one", tokenizer_path)
    _, parted = prepare(tmp_path / "two", tokenizer_path, partitions=2)

    def documents(prefix):
        tokens, mask = IndexedDataReader(prefix), IndexedDataReader(f"{prefix}_loss_mask")
        assert mask.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
        return [(tuple(tokens[i].tolist()), tuple(mask[i].tolist())) for i in range(len(tokens))]

    by_record = documents(whole)
    assert documents(parted) == [by_record[i] for i in (0, 2, 1, 3)]  # partition 0 holds records 0 and 2


def test_an_appended_eod_ends_each_document_and_is_never_a_target(tmp_path, tokenizer_path):
    _, prefix = prepare(tmp_path, tokenizer_path, append_eod=True)
    tokens, mask = IndexedDataReader(prefix), IndexedDataReader(f"{prefix}_loss_mask")
    for document, sample in enumerate(online_samples(tokenizer_path)):
        assert tokens[document].tolist()[-1] == 0 and mask[document].tolist()[-1] == 0  # the bundled EOD is 0
        assert tokens[document].tolist()[:-2] == sample["input_ids"].tolist()


def test_records_without_loss_or_with_bad_messages_stop_the_run_or_are_counted_and_skipped(tmp_path, tokenizer_path):
    conversations = [
        CONVERSATIONS[0],
        [{"role": "user", "content": "Hi"}],  # nothing supervised
        [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}],
        CONVERSATIONS[1],
    ]
    with pytest.raises(DataFileError) as raised:
        prepare(tmp_path, tokenizer_path, conversations)
    for fragment in ["chats.jsonl:line 2", "no message is supervised", "--skip-bad-records"]:
        assert fragment in str(raised.value)
    assert "on_invalid_record" not in str(raised.value)  # an Online option, not a flag of this command
    summary, prefix = prepare(tmp_path, tokenizer_path, conversations, skip_bad_records=True)
    assert (summary.bad_records, summary.documents) == (2, 2)
    assert len(IndexedDataReader(f"{prefix}_loss_mask")) == 2


def test_the_role_map_renames_dataset_roles_and_an_unknown_role_is_named(tmp_path, tokenizer_path):
    conversations = [[{"from": "customer", "value": "Hi"}, {"from": "agent", "value": "Hello."}]]
    with pytest.raises(
        DataFileError, match=r"chats.jsonl:line 1, field 'messages': message 0: unknown role 'customer'.*role_map"
    ):
        prepare(tmp_path, tokenizer_path, conversations)
    _, prefix = prepare(tmp_path, tokenizer_path, conversations, role_map={"customer": "user", "agent": "assistant"})
    tokens = build_llm_data_transform("conversation", tokenizer_path, chat_template="chatml").tokenizer
    assert tokens.decode(IndexedDataReader(prefix)[0].tolist()).startswith("<|im_start|>user\nHi")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"text_template": "{messages}"}, "cannot be combined with text_template"),
        ({"json_keys": ("messages", "chosen")}, "needs exactly one json key"),
        ({"chat_template": None, "role_map": {"human": "user"}}, "role_map renames the roles .* needs --chat-template"),
    ],
)
def test_settings_that_cannot_go_with_a_chat_template_are_refused(tmp_path, options, message):
    settings = {"json_keys": ("messages",), "chat_template": "chatml", **options}
    with pytest.raises(DataConfigError, match=message):
        OfflinePreparationConfig(
            dataset_name_or_path="x.jsonl", output_prefix=str(tmp_path / "p"), tokenizer_name_or_path="t", **settings
        )


def test_the_command_line_writes_both_pairs(tmp_path, tokenizer_path, restore_package_logger, capsys):
    conversation = [{"from": "customer", "value": "Who wrote Emma?"}, {"from": "gpt", "value": "Jane Austen."}]
    data = write_conversations(tmp_path / "chats.jsonl", [conversation])
    flags = ["--dataset-name-or-path", data, "--output-prefix", str(tmp_path / "cli"), "--json-keys", "messages"]
    flags += ["--tokenizer-name-or-path", str(tokenizer_path), "--chat-template", "chatml", "--workers", "1"]
    assert main([*flags, "--role-map", "customer=user"]) == 0
    assert "output [messages_loss_mask]" in capsys.readouterr().out
    assert len(IndexedDataReader(tmp_path / "cli_messages_document_loss_mask")) == 1


# -- read by the Indexed path ---------------------------------------------------------------------------------------


def test_a_sample_holding_one_whole_conversation_is_the_online_sample(tmp_path, tokenizer_path):
    """One conversation of n tokens and seq_length n - 1: the one sample is the Online transform's sample."""
    (expected,) = online_samples(tokenizer_path, CONVERSATIONS[2:3])
    _, prefix = prepare(tmp_path, tokenizer_path, CONVERSATIONS[2:3])
    dataset = train_split(prefix, tokenizer_path, len(expected["input_ids"]))
    assert len(dataset) == 1
    sample = dataset[0]
    assert sample["tokens"].tolist() == expected["input_ids"].tolist()
    assert sample["labels"].tolist() == expected["labels"].tolist()
    assert sample["loss_mask"].tolist() == (expected["labels"] != IGNORE_INDEX).astype(np.float32).tolist()


@pytest.mark.parametrize("add_extra_token", [True, False])
def test_samples_cut_across_conversations_train_on_exactly_the_online_targets(
    tmp_path, tokenizer_path, add_extra_token
):
    """Samples of 24 tokens cut across the shuffled conversations: each position's label and loss are those of the
    Online sample of the conversation its target belongs to; a conversation's first token, never a target online,
    is no target across a boundary either."""
    online = online_samples(tokenizer_path)
    assert all(sample["labels"][-1] != IGNORE_INDEX for sample in online)  # so the last token is the last label
    tokens_of = [np.append(s["input_ids"], s["labels"][-1]) for s in online]
    targets_of = [np.append(False, s["labels"] != IGNORE_INDEX) for s in online]  # per token: a supervised target
    _, prefix = prepare(tmp_path, tokenizer_path)
    dataset = train_split(prefix, tokenizer_path, 24, add_extra_token_to_sequence=add_extra_token)
    order = dataset.document_index.tolist()
    stream = np.concatenate([tokens_of[d] for d in order])
    targets = np.concatenate([targets_of[d] for d in order])
    starts = np.cumsum([0] + [len(tokens_of[d]) for d in order])
    samples = dataset.__getitems__(list(range(len(dataset))))
    assert len(samples) == len(dataset) > 2
    for position, sample in enumerate(samples):
        first, offset = dataset.sample_index[dataset.shuffle_index[position]].tolist()
        begin = starts[first] + offset
        tokens = stream[begin : begin + 24]
        trained = targets[begin + 1 : begin + 25]
        if not add_extra_token:
            trained = np.append(targets[begin + 1 : begin + 24], False)  # the last position has no target
        labels = np.where(
            trained, stream[begin + 1 : begin + 25] if add_extra_token else np.append(tokens[1:], 0), -100
        )
        assert sample["tokens"].tolist() == tokens.tolist()
        assert sample["labels"].tolist() == labels.tolist()
        assert sample["loss_mask"].tolist() == trained.astype(np.float32).tolist()
        assert dataset[position]["labels"].tolist() == labels.tolist()  # one at a time, the same


def test_read_loss_mask_off_trains_every_token_and_required_refuses_a_prefix_without_one(tmp_path, tokenizer_path):
    _, prefix = prepare(tmp_path, tokenizer_path)
    off = train_split(prefix, tokenizer_path, 24, read_loss_mask="off")
    assert off[0]["loss_mask"].tolist() == [1.0] * 24 and off.loss_mask_pair is None
    plain = IndexedDataReader(prefix)
    with IndexedDatasetBuilder(tmp_path / "plain.bin", dtype=plain.dtype) as builder:
        builder.add_documents(np.concatenate(plain[0 : len(plain)]), plain.sequence_lengths)
        builder.finalize(tmp_path / "plain.idx")
    assert train_split(str(tmp_path / "plain"), tokenizer_path, 24).loss_mask_pair is None  # auto: none there
    with pytest.raises(DataFileError, match=r"plain has no loss-mask pair .*plain_loss_mask.*'required'"):
        train_split(str(tmp_path / "plain"), tokenizer_path, 24, read_loss_mask="required")
    with pytest.raises(DataConfigError, match="read_loss_mask must be one of"):
        train_split(prefix, tokenizer_path, 24, read_loss_mask="yes")


def write_mask(prefix: str, documents: list[list[int]]) -> None:
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint8) as builder:
        builder.add_documents(np.concatenate(documents).astype(np.uint8), [len(d) for d in documents])
        builder.finalize(f"{prefix}.idx")


def test_a_mask_pair_whose_document_lengths_differ_from_the_tokens_is_a_clear_error(tmp_path, tokenizer_path):
    _, prefix = prepare(tmp_path, tokenizer_path)
    lengths = IndexedDataReader(prefix).sequence_lengths.tolist()
    write_mask(f"{prefix}_loss_mask", [[1] * n for n in [lengths[0], lengths[1] + 1, *lengths[2:]]])
    with pytest.raises(DataFileError) as raised:
        train_split(prefix, tokenizer_path, 24)
    for fragment in [
        f"{prefix}_loss_mask: the loss mask does not match the tokens of {prefix}",
        f"sequence 1 of {lengths[1] + 1} entries where the tokens have {lengths[1]}",
        "hp-data prepare --chat-template",
    ]:
        assert fragment in str(raised.value)
    write_mask(f"{prefix}_loss_mask", [[1] * n for n in lengths[:-1]])
    with pytest.raises(
        DataFileError, match=rf"it has {len(lengths) - 1} sequences where the tokens have {len(lengths)}"
    ):
        train_split(prefix, tokenizer_path, 24)
    write_mask(f"{prefix}_loss_mask", [[2] * n for n in lengths])
    with pytest.raises(DataFileError, match="a loss mask holds 0 and 1 only, but it holds 2"):
        train_split(prefix, tokenizer_path, 24)[0]


def test_a_directory_of_pairs_reads_a_mask_pair_with_its_tokens_not_as_data(tmp_path, tokenizer_path):
    _, prefix = prepare(tmp_path, tokenizer_path)
    assert parse_blend(str(tmp_path)).prefixes == (prefix,)
