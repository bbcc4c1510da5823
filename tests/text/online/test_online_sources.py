"""Online sources over real files read by Hugging Face ``datasets``: formats, streaming cursor, config checks."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.text.build_dataset import build_online_text_dataset
from hyper_parallel.data.text.online.online_dataset import OnlineDataConfig, open_online_source
from hyper_parallel.data.text.online.online_iterable_dataset import OnlineIterableDataset
from hyper_parallel.data.text.online.online_utils import open_hf_dataset

RECORDS = [{"id": index, "text": f"record number {index}"} for index in range(23)]


def write_format(folder, fmt: str, records=RECORDS, name: str = "data"):
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(records)
    path = folder / f"{name}.{ {'json': 'jsonl'}.get(fmt, fmt) }"
    if fmt == "json":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "csv":
        path.write_text("id,text\n" + "".join(f"{r['id']},{r['text']}\n" for r in records))
    elif fmt == "arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return path


def ids(records) -> list[int]:
    return [int(record["id"]) for record in records]


@pytest.mark.parametrize("fmt", ["json", "parquet", "csv", "arrow"])
@pytest.mark.parametrize("streaming", [False, True])
def test_every_local_format_reads_the_same_records(fmt, streaming, tmp_path):
    path = write_format(tmp_path / fmt, fmt)
    dataset, description = open_hf_dataset(path, streaming=streaming, cache_dir=tmp_path / "cache")
    assert str(path) in description
    assert ids(dataset) == list(range(23))
    assert [r["text"] for r in dataset][:2] == ["record number 0", "record number 1"]


def test_globs_and_directories_read_files_in_path_order(tmp_path):
    write_format(tmp_path / "parts", "json", RECORDS[10:], name="b")
    write_format(tmp_path / "parts", "json", RECORDS[:10], name="a")
    for spec in (tmp_path / "parts", str(tmp_path / "parts" / "*.jsonl")):
        dataset, description = open_hf_dataset(spec, streaming=False, cache_dir=tmp_path / "cache")
        assert ids(dataset) == list(range(23))
        assert "2 json files" in description


@pytest.mark.parametrize("streaming", [False, True])
def test_a_list_of_files_and_globs_reads_them_in_the_order_given(tmp_path, streaming):
    """Each entry's files in path order, the entries in list order: the later-named glob comes first here."""
    write_format(tmp_path / "parts", "json", RECORDS[:5], name="a")
    write_format(tmp_path / "parts", "json", RECORDS[5:9], name="b")
    last = write_format(tmp_path, "json", RECORDS[9:], name="z")
    spec = [str(tmp_path / "parts" / "*.jsonl"), last]
    dataset, description = open_hf_dataset(spec, streaming=streaming, cache_dir=tmp_path / "cache")
    assert ids(dataset) == list(range(23))
    assert "3 json files" in description
    reversed_spec = [last, str(tmp_path / "parts" / "*.jsonl")]
    dataset, _ = open_hf_dataset(reversed_spec, streaming=streaming, cache_dir=tmp_path / "cache")
    assert ids(dataset) == list(range(9, 23)) + list(range(9))


def test_a_data_path_list_is_checked(tmp_path):
    path = write_format(tmp_path, "json")
    with pytest.raises(DataFileError, match="names .*data.jsonl twice"):
        open_hf_dataset([path, str(tmp_path / "*.jsonl")], streaming=False)
    with pytest.raises(DataFileError, match="mixes formats"):
        open_hf_dataset([path, write_format(tmp_path, "csv")], streaming=False)
    with pytest.raises(DataConfigError, match="empty list"):
        open_hf_dataset([], streaming=False)
    with pytest.raises(DataConfigError, match="entry 3 is a int"):
        open_hf_dataset([path, 3], streaming=False)
    with pytest.raises(DataFileError, match="matches no files"):
        open_hf_dataset([path, str(tmp_path / "missing*.jsonl")], streaming=False)


def test_the_online_builder_takes_data_path_lists_from_yaml(tmp_path, tokenizer):
    """A YAML list reaches the builder through instantiate, for the train and the validation paths."""
    from hyper_parallel.data.instantiate import instantiate, load_config_text

    first = write_format(tmp_path, "json", RECORDS[:3], name="first")
    second = write_format(tmp_path, "json", RECORDS[3:5], name="second")
    config = load_config_text(
        f"""
_target_: hyper_parallel.data.text.build_dataset.build_online_text_dataset
data_path: [{first}, {second}]
data_transform: {{data_type: plaintext, max_seq_len: 32}}
data_config: {{valid_data_path: [{second}], cache_dir: {tmp_path / "cache"}}}
"""
    )
    train, valid, test = instantiate(config, context={"tokenizer": tokenizer})
    assert (len(train), len(valid), test) == (5, 2, None)
    (sample,) = train[3]
    assert tokenizer.decode(sample["input_ids"]) == "record number 3"


def test_save_to_disk_directories_and_their_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_list(RECORDS[:5]), "test": Dataset.from_list(RECORDS[5:])}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    for streaming in (False, True):
        dataset, _ = open_hf_dataset(tmp_path / "saved", streaming=streaming)
        assert ids(dataset) == list(range(23))
        dataset, _ = open_hf_dataset(tmp_path / "saved_dict", streaming=streaming, split="test")
        assert ids(dataset) == list(range(5, 23))
    with pytest.raises(DataConfigError, match=r"has splits \['test', 'train'\], not 'valid'; set split"):
        open_hf_dataset(tmp_path / "saved_dict", streaming=False, split="valid")


def test_unreadable_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl"):
        open_hf_dataset(bad, streaming=False, cache_dir=tmp_path / "cache")
    source = stream(bad)
    with pytest.raises(DataFileError, match=r"bad\.jsonl: reading the stream failed"):
        read_all(source)
    with pytest.raises(DataFileError, match="no such file"):
        open_hf_dataset(tmp_path / "missing.jsonl", streaming=True)


def stream(path, **options) -> OnlineIterableDataset:
    source = open_online_source(path, OnlineDataConfig(dataset_type="iterable", **options.pop("config", {})), **options)
    assert isinstance(source, OnlineIterableDataset)
    return source


def read_all(source) -> list[int]:
    found = []
    while batch := source.read(4):
        found += [record["id"] for _, record in batch]
    return found


@pytest.mark.parametrize("buffer_size", [0, 5, 100])
def test_a_stream_restored_anywhere_continues_exactly(buffer_size, tmp_path):
    path = write_format(tmp_path, "json")
    config = {"shuffle_buffer_size": buffer_size}
    reference = read_all(stream(path, config=config, seed=3))
    assert sorted(reference) == list(range(23))
    assert (reference == list(range(23))) == (buffer_size == 0)
    for stop in (1, 7, 20, 23):
        source = stream(path, config=config, seed=3)
        head = [record["id"] for _, record in source.read(stop)]
        state = json.loads(json.dumps(source.state_dict()))  # plain containers only
        restored = stream(path, config=config, seed=3)
        restored.load_state_dict(state)
        assert head + read_all(restored) == reference
    assert restored.epoch == 1 and restored.position == 0


@pytest.mark.parametrize(("buffer_size", "dp_world_size"), [(0, 1), (40, 1), (0, 2), (40, 2)])
def test_a_stream_restored_across_read_blocks_continues_exactly(buffer_size, dp_world_size, tmp_path):
    # Two files of 300 records: the stream reads them in blocks of 128, so stops fall before, inside and after them.
    records = [{"id": index, "text": f"record number {index}"} for index in range(600)]
    paths = [write_format(tmp_path, "json", records[:300], "a"), write_format(tmp_path, "json", records[300:], "b")]
    options = {"config": {"shuffle_buffer_size": buffer_size}, "seed": 5, "dp_world_size": dp_world_size}
    shares = [read_all(stream(paths, dp_rank=rank, **options)) for rank in range(dp_world_size)]
    assert sorted(sum(shares, [])) == list(range(600))
    for stop in (1, 127, 128, 129, 250, 299):
        source = stream(paths, dp_rank=dp_world_size - 1, **options)
        head = [record["id"] for _, record in source.read(stop)]
        state = json.loads(json.dumps(source.state_dict()))
        restored = stream(paths, dp_rank=dp_world_size - 1, **options)
        restored.load_state_dict(state)
        assert head + read_all(restored) == shares[-1], stop


def test_the_shuffle_and_its_saved_generator_are_those_of_one_draw_per_record(tmp_path):
    # The buffer shuffle spelled out with one draw per record: a new record replaces a random buffered one and
    # releases it, then the rest drain in random order. Every saved cursor holds that generator's state, so a
    # state saved by any release continues the same order.
    import numpy as np

    records = [{"id": index, "text": f"record number {index}"} for index in range(600)]
    path = write_format(tmp_path, "json", records)
    size, seed, read = 40, 5, 7
    rng, buffer, expected, states = np.random.default_rng([seed, 0, 0]), [], [], []  # states after each record
    for index in range(600):
        if len(buffer) < size:
            buffer.append(index)
            continue
        slot = int(rng.integers(size))
        expected.append(buffer[slot])
        buffer[slot] = index
        states.append(rng.bit_generator.state)
    while buffer:
        slot = int(rng.integers(len(buffer)))
        buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
        expected.append(buffer.pop())
        states.append(rng.bit_generator.state)
    source = stream(path, config={"shuffle_buffer_size": size}, seed=seed)
    found, saved = [], []
    while batch := source.read(read):
        found += [record["id"] for _, record in batch]
        if len(batch) == read:
            saved.append(source.state_dict()["rng"])
    assert found == expected
    assert saved == states[read - 1 :: read][: len(saved)]


def test_a_formatted_stream_gives_its_formatted_records_and_resumes_exactly(tmp_path):
    # Plain rows are read as Arrow tables; a stream with an output format is read through datasets' formatter.
    import numpy as np

    path = write_format(tmp_path, "json")
    dataset, description = open_hf_dataset(path, streaming=True, cache_dir=tmp_path / "cache")
    formatted = OnlineIterableDataset(dataset.with_format("numpy"), description, shuffle_buffer_size=0)
    head = formatted.read(5)
    assert all(isinstance(record["id"], np.integer) for _, record in head)
    restored = OnlineIterableDataset(dataset.with_format("numpy"), description, shuffle_buffer_size=0)
    restored.load_state_dict(formatted.state_dict())
    assert ids(record for _, record in head) + read_all(restored) == list(range(23))
    plain = OnlineIterableDataset(dataset, description, shuffle_buffer_size=0)
    assert [type(record["id"]) for _, record in plain.read(5)] == [int] * 5


def test_a_version_1_stream_state_still_resumes_exactly(tmp_path):
    # A version 1 cursor, as the record-by-record reader saved it: the Hugging Face state after `stop` records.
    from datasets.distributed import split_dataset_by_node

    records = [{"id": index, "text": f"record number {index}"} for index in range(300)]
    path = write_format(tmp_path, "json", records)
    source = stream(path, config={"shuffle_buffer_size": 0})
    shard = split_dataset_by_node(source.hf_dataset, rank=0, world_size=1)
    stop = 70
    for _, _ in zip(range(stop), shard, strict=False):
        pass
    state = {
        "version": 1,
        "epoch": 0,
        "position": stop,
        "dp_rank": 0,
        "dp_world_size": 1,
        "seed": 1234,
        "shuffle_buffer_size": 0,
        "source_state": shard.state_dict(),
        "source_exhausted": False,
        "buffer": [],
        "rng": source.state_dict()["rng"],
    }
    source.load_state_dict(json.loads(json.dumps(state)))
    assert read_all(source) == list(range(stop, 300))
    assert read_all(source) == list(range(300))  # the next epoch reads in blocks again


def test_a_stream_refuses_a_damaged_read_block(tmp_path):
    path = write_format(tmp_path, "json")
    source = stream(path, config={"shuffle_buffer_size": 0})
    source.read(3)
    state = source.state_dict()
    assert [record["id"] for record in state["block"]] == list(range(3, 23))
    with pytest.raises(ResumeStateError, match="block_records"):
        stream(path, config={"shuffle_buffer_size": 0}).load_state_dict({**state, "block_records": 0})
    with pytest.raises(ResumeStateError, match=r"\['block'\]\[0\]"):
        stream(path, config={"shuffle_buffer_size": 0}).load_state_dict({**state, "block": ["text"]})


def test_stream_positions_count_records_and_epochs_reshuffle(tmp_path):
    source = stream(write_format(tmp_path, "json"), config={"shuffle_buffer_size": 8})
    first = source.read(30)
    assert [position for position, _ in first] == list(range(23))
    assert source.read(1) == [] and source.epoch == 1
    second = [record["id"] for _, record in source.read(30)]
    assert sorted(second) == list(range(23)) and second != [record["id"] for _, record in first]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dp_world_size": 2}, "dp_world_size"),
        ({"seed": 9}, "seed"),
        ({"config": {"shuffle_buffer_size": 3}}, "shuffle"),
    ],
)
def test_a_stream_refuses_a_state_it_cannot_continue(change, message, tmp_path):
    path = write_format(tmp_path, "json")
    source = stream(path)
    source.read(3)
    with pytest.raises(ResumeStateError, match=message):
        stream(path, **change).load_state_dict(source.state_dict())


def test_online_data_config_is_checked():
    with pytest.raises(DataConfigError, match="dataset_type is 'streaming'"):
        OnlineDataConfig(dataset_type="streaming")
    with pytest.raises(DataConfigError, match=r"unknown data_config keys \['shuffle'\]"):
        OnlineDataConfig.from_mapping({"shuffle": True})
    with pytest.raises(DataConfigError, match="shuffle_buffer_size"):
        OnlineDataConfig(shuffle_buffer_size=-1)


def test_separate_valid_and_test_files_give_three_datasets(tmp_path, tokenizer):
    train, valid = write_format(tmp_path, "json", name="train"), write_format(tmp_path, "json", RECORDS[:4], "valid")
    splits = build_online_text_dataset(
        train,
        {"data_type": "plaintext", "max_seq_len": 64},
        {"valid_data_path": str(valid), "cache_dir": str(tmp_path / "cache")},
        tokenizer=tokenizer,
    )
    assert [None if s is None else len(s) for s in splits] == [23, 4, None]
    (sample,) = splits[1][2]
    assert tokenizer.decode(sample["input_ids"]) == "record number 2"


def test_the_online_builder_names_what_is_missing(tmp_path, tokenizer):
    with pytest.raises(DataConfigError, match="data_path"):
        build_online_text_dataset(None, {"data_type": "plaintext", "max_seq_len": 8}, tokenizer=tokenizer)
    with pytest.raises(DataConfigError, match="data_transform"):
        build_online_text_dataset(write_format(tmp_path, "json"), None, tokenizer=tokenizer)


@pytest.mark.parametrize("view", ["plain", "shuffled", "formatted", "columns"])
def test_mapping_batched_reads_give_the_records_datasets_gives(view, tmp_path):
    from hyper_parallel.data.text.online.online_mapping_dataset import OnlineMappingDataset

    hf_dataset, description = open_hf_dataset(write_format(tmp_path, "parquet"), streaming=False)
    hf_dataset = {
        "plain": lambda d: d,
        "shuffled": lambda d: d.shuffle(seed=2),  # an index mapping over the Arrow table
        "formatted": lambda d: d.with_format("numpy"),
        "columns": lambda d: d.select_columns(["text"]),
    }[view](hf_dataset)
    indices = [22, 0, 5, 5, 13]
    expected = [hf_dataset[index] for index in indices]  # one record at a time, through datasets' own formatting
    got = OnlineMappingDataset(hf_dataset, description).records(indices)
    assert len(got) == len(expected)
    for record, reference in zip(got, expected, strict=True):
        assert record.keys() == reference.keys()
        assert all(type(record[key]) is type(reference[key]) and record[key] == reference[key] for key in record)
    if view == "plain":
        assert [record["id"] for record in got] == indices
