"""Specification of the builder's one blend decision, ``blend_kind``: which dataset tops a split of a blend, as
megatron-core's builder decides (the datasets themselves are compared with megatron-core in
``test_megatron_parity``)."""

from __future__ import annotations

import json

import pytest

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_config import Blend
from hyper_parallel.data.indexed.indexed_split_builder import BlendKind, blend_kind
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset

from .test_index_cache import write_corpus

ONE = Blend(("a",))
ONE_WEIGHTED = Blend(("a",), (1.0,))
TWO = Blend(("a", "b"))
TWO_WEIGHTED = Blend(("a", "b"), (0.3, 0.7))


@pytest.mark.parametrize(
    ("blend", "per_split", "kind"),
    [
        (ONE, False, BlendKind.NONE),
        (ONE, True, BlendKind.NONE),
        (ONE_WEIGHTED, False, BlendKind.WEIGHTED),  # megatron-core blends a single weighted prefix of data_path
        (ONE_WEIGHTED, True, BlendKind.NONE),  # but not one of a per-split path, whatever its weight
        (TWO, False, BlendKind.BY_SIZE),
        (TWO, True, BlendKind.BY_SIZE),
        (TWO_WEIGHTED, False, BlendKind.WEIGHTED),
        (TWO_WEIGHTED, True, BlendKind.WEIGHTED),
    ],
)
def test_without_simple_blend_megatron_core_decides(blend, per_split, kind):
    assert blend_kind(blend, "no", per_split) is kind


@pytest.mark.parametrize("mode", ["inter", "intra"])
@pytest.mark.parametrize("blend", [ONE, ONE_WEIGHTED, TWO, TWO_WEIGHTED])
@pytest.mark.parametrize("per_split", [False, True])
def test_a_simple_blend_tops_every_split_whatever_the_weights_and_sources(mode, blend, per_split):
    assert blend_kind(blend, mode, per_split) is BlendKind(mode)


# -- the per_dataset_sequences_path file ---------------------------------------------------------------------------

FIX = "write it again with `python -m hyper_parallel.data.tools.build_sequences_per_dataset --data-path"
MALFORMED_COUNTS = {
    # name: (the file's text, with {a} and {b} for the two prefixes; what the message says after the file)
    "a-list": ('[["{a}", [50, 51]]]', "holds the JSON array [["),
    "null": ("null", "holds null, but it must be a JSON object {{prefix: [sequence_count, document_count], ...}}"),
    "a-string": ('"{a}"', "holds the JSON string"),
    "a-number": ("50", "holds the JSON number 50"),
    "null-count": (
        '{{"{a}": [null, 51], "{b}": [50, 51]}}',
        "'{a}': sequence_count is null, but it must",
    ),
    "float-count": ('{{"{a}": [50.0, 51], "{b}": [50, 51]}}', "'{a}': sequence_count is the JSON number 50.0"),
    "float-document-count": ('{{"{a}": [50, 51.5], "{b}": [50, 51]}}', "'{a}': document_count is the JSON number 51.5"),
    "nan-count": ('{{"{a}": [NaN, 51], "{b}": [50, 51]}}', "'{a}': sequence_count is the JSON number NaN"),
    "bool-count": ('{{"{a}": [true, 51], "{b}": [50, 51]}}', "'{a}': sequence_count is the JSON boolean true"),
    "string-count": ('{{"{a}": ["50", 51], "{b}": [50, 51]}}', "'{a}': sequence_count is the JSON string \"50\""),
    "negative-count": ('{{"{a}": [50, 51], "{b}": [-1, 51]}}', "'{b}': sequence_count is the JSON number -1"),
    "no-document": ('{{"{a}": [50, 0], "{b}": [50, 51]}}', "'{a}': document_count is the JSON number 0, but it must"),
    "past-int64": (
        '{{"{a}": [50, 51], "{b}": [50, 9223372036854775808]}}',
        "'{b}': document_count is the JSON number 9223372036854775808, but it must be an integer in [1, 2**63 - 1]",
    ),
    "past-int64-sequences": ('{{"{a}": [1e400, 51], "{b}": [50, 51]}}', "'{a}': sequence_count is the JSON number"),
    "a-scalar": ('{{"{a}": 50, "{b}": [50, 51]}}', "'{a}' maps to the JSON number 50, but each prefix must map to"),
    "an-object": ('{{"{a}": {{"sequences": 50}}, "{b}": [50, 51]}}', "'{a}' maps to the JSON object"),
    "three-counts": ('{{"{a}": [50, 51, 0], "{b}": [50, 51]}}', "'{a}' maps to the JSON array [50, 51, 0]"),
    "one-count": ('{{"{a}": [50], "{b}": [50, 51]}}', "'{a}' maps to the JSON array [50]"),
    "empty-list": ('{{"{a}": [], "{b}": [50, 51]}}', "'{a}' maps to the JSON array []"),
    "invalid-json": ('{{"{a}": [50, 51],', "holds invalid JSON (Expecting property name"),
    "too-many-digits": ('{{"{a}": [' + "9" * 5000 + ", 51]}}", "holds invalid JSON (Exceeds the limit"),
    "empty-file": ("", "holds invalid JSON (Expecting value"),
}


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory) -> tuple[str, str]:
    directory = tmp_path_factory.mktemp("pair")
    return (
        write_corpus(directory / "a_text_document", num_documents=50, seed=1),
        write_corpus(directory / "b_text_document", num_documents=50, seed=2),
    )


def _build(data_path, counts_path, tmp_path, tokenizer, **settings):
    config = {"seq_length": 32, "split": "90, 8, 2", "data_cache_path": str(tmp_path / "cache")}
    config.update(per_dataset_sequences_path=str(counts_path), **settings)
    return build_indexed_text_dataset(data_path, config, [200, 30, 10], tokenizer)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", list(MALFORMED_COUNTS))
def test_a_malformed_counts_file_is_one_error_naming_the_file_the_prefix_and_the_fix(
    tmp_path, tokenizer, two_prefixes, name, lazy
):
    """Whatever is wrong in the file, the build refuses it with one ``DataFileError`` naming the file, the prefix
    (for an entry), the value and how to write the file again, before anything is sized from it."""
    a, b = two_prefixes
    text, said = MALFORMED_COUNTS[name]
    counts_path = tmp_path / "sequences.json"
    counts_path.write_text(text.format(a=a, b=b), encoding="utf-8")

    with pytest.raises(DataFileError) as refused:
        _build(["30", a, "70", b], counts_path, tmp_path, tokenizer, data_lazy_load=lazy)

    message = str(refused.value)
    assert message.startswith(f"per_dataset_sequences_path {counts_path}"), message
    assert said.format(a=a, b=b) in message, message
    assert f"{FIX} <this run's data paths> --per-dataset-sequences-path {counts_path}`" in message
    assert "\n" not in message and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda path: path.write_bytes(b'{"\xff": [1, 2]}'), "is not UTF-8 JSON (byte 2"),
        (lambda path: path.mkdir(), "cannot be read (Is a directory)"),
        (lambda path: path.write_text("[" * 100_000 + "]" * 100_000), "holds invalid JSON"),
    ],
    ids=["latin-1", "a-directory", "deep-nesting"],
)
def test_a_counts_file_that_cannot_be_read_as_json_names_it(tmp_path, tokenizer, two_prefixes, make, said):
    a, _ = two_prefixes
    counts_path = tmp_path / "sequences.json"
    make(counts_path)

    with pytest.raises(DataFileError) as refused:
        _build(a, counts_path, tmp_path, tokenizer)

    assert str(refused.value).startswith(f"per_dataset_sequences_path {counts_path} {said}"), str(refused.value)
    assert FIX in str(refused.value)


@pytest.mark.parametrize("where", ["data_path", "valid_data_path"])
def test_a_prefix_missing_from_the_counts_file_names_it_and_the_fix(tmp_path, tokenizer, two_prefixes, where):
    a, b = two_prefixes
    counts_path = tmp_path / "sequences.json"
    counts_path.write_text(json.dumps({a: [50, 51]}), encoding="utf-8")
    paths = {"data_path": ["30", a, "70", b]} if where == "data_path" else {"train_data_path": a, "valid_data_path": b}

    with pytest.raises(DataConfigError) as refused:
        if where == "data_path":
            _build(paths["data_path"], counts_path, tmp_path, tokenizer)
        else:
            _build(None, counts_path, tmp_path, tokenizer, **paths)

    message = str(refused.value)
    assert message.startswith(f"prefix '{b}' is missing from per_dataset_sequences_path {counts_path}")
    assert "which lists 1 other prefixes" in message
    assert f"{FIX} <this run's data paths> --per-dataset-sequences-path {counts_path}`" in message
