"""Specification of the Indexed-path configuration: ``IndexedDataConfig`` validation, split strings (parsed and
turned into ranges exactly as megatron-core does), blend lists and directory discovery, and the per-dataset
sequences file."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_config import (
    Blend,
    IndexedDataConfig,
    parse_blend,
    parse_split,
    split_matrix,
    split_range,
)

# -- IndexedDataConfig --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"seq_length": 0}, ["seq_length", "0"]),
        ({"seq_length": -3}, ["seq_length", "-3"]),
        ({"seq_length": 8.0}, ["seq_length", "8.0"]),
        ({"simple_blend": "inter"}, ["simple_blend", "'inter'", "is_dataset_from_mr: true"]),
        ({"simple_blend": "intra"}, ["simple_blend", "'intra'", "is_dataset_from_mr: true"]),
        ({"simple_blend": "round_robin", "is_dataset_from_mr": True}, ["simple_blend", "'round_robin'", "'inter'"]),
        ({"mid_level_dataset_surplus": -0.1}, ["mid_level_dataset_surplus", "-0.1"]),
        ({"random_seed": -1}, ["random_seed", "-1"]),
        ({"random_seed": 2**32}, ["random_seed", str(2**32)]),
        ({"fast_cache_load": True}, ["fast_cache_load", "data_cache_path"]),
        ({"defer_npy_index_mmap": True}, ["defer_npy_index_mmap", "data_cache_path"]),
        ({"mock_data": True, "is_dataset_from_mr": True}, ["mock_data", "is_dataset_from_mr"]),
        ({"split": "1, 2, 3, 4"}, ["split", "'1, 2, 3, 4'"]),
        ({"seq_length": True}, ["seq_length", "bool True"]),
        ({"seq_length": 4096.5}, ["seq_length", "4096.5"]),
        ({"seq_length": "4096"}, ["seq_length", "'4096'"]),
        ({"random_seed": True}, ["random_seed", "bool True"]),
        ({"random_seed": 1.5}, ["random_seed", "1.5"]),
        ({"random_seed": "7"}, ["random_seed", "'7'"]),
        ({"random_seed": 2**40}, ["random_seed", str(2**40), "2**32 - 1", "RandomState"]),
        ({"mid_level_dataset_surplus": True}, ["mid_level_dataset_surplus", "True"]),
        ({"mid_level_dataset_surplus": "0.1"}, ["mid_level_dataset_surplus", "'0.1'"]),
        ({"mid_level_dataset_surplus": float("inf")}, ["mid_level_dataset_surplus", "inf"]),
        ({"mock_data": "false"}, ["mock_data", "'false'", "true or false", "unquoted"]),
        ({"add_extra_token_to_sequence": 0}, ["add_extra_token_to_sequence", "0", "true or false"]),
        ({"data_cache_path": 5}, ["data_cache_path", "5", "path"]),
        ({"per_dataset_sequences_path": ["a.json"]}, ["per_dataset_sequences_path", "['a.json']", "path"]),
        ({"train_data_path": 7}, ["train_data_path", "7", "path"]),
        ({"split": "98,1,abc"}, ["split", "'98,1,abc'", "one to three non-negative numbers"]),
    ],
    ids=[
        "seq_length_0",
        "seq_length_negative",
        "seq_length_float",
        "inter_without_mr",
        "intra_without_mr",
        "unknown_simple_blend",
        "negative_surplus",
        "seed_negative",
        "seed_too_large",
        "fast_cache_load_without_cache",
        "defer_without_cache",
        "mock_with_mr",
        "bad_split",
        "seq_length_bool",
        "seq_length_fractional",
        "seq_length_string",
        "seed_bool",
        "seed_float",
        "seed_string",
        "seed_above_randomstate",
        "surplus_bool",
        "surplus_string",
        "surplus_infinite",
        "flag_quoted_string",
        "flag_integer",
        "cache_path_number",
        "sequences_path_list",
        "data_path_number",
        "split_with_a_word",
    ],
)
def test_invalid_settings_are_refused_naming_the_field(settings, named):
    """Each invalid setting is a ``DataConfigError`` at construction whose message names the field and the value
    (and, for contradictions, the other setting)."""
    with pytest.raises(DataConfigError) as error:
        IndexedDataConfig(**{"seq_length": 8, **settings})
    for text in named:
        assert text in str(error.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"seq_length": 1},
        {"random_seed": 0},
        {"random_seed": 2**32 - 1},
        {"mid_level_dataset_surplus": 0.0},
        {"simple_blend": "inter", "is_dataset_from_mr": True},
        {"simple_blend": "intra", "is_dataset_from_mr": True},
        {"fast_cache_load": True, "defer_npy_index_mmap": True, "data_cache_path": "/cache"},
        {"mock_data": True},
        {"split": None},
        {"split": "1, 2, 3, 4", "train_data_path": "/data/a"},  # the split is unused with per-split paths
    ],
)
def test_boundary_settings_are_accepted(settings):
    """The limits themselves are valid: seed 0 and 2**32 - 1, surplus 0, seq_length 1; simple blends with packed
    records; the cache options with a cache path; no split, and any split string when per-split paths replace it."""
    config = IndexedDataConfig(**{"seq_length": 8, **settings})
    for name, value in settings.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("settings", "together", "synchronize"),
    [
        ({}, True, True),
        ({}, False, False),
        ({"data_lazy_load": True}, True, False),  # lazy datasets are built at different moments on each rank
        ({"fast_cache_load": True}, True, False),  # nothing is built
        ({"fast_cache_load": True, "defer_npy_index_mmap": True, "data_lazy_load": True}, True, False),
    ],
)
def test_cache_options_decide_once_whether_ranks_build_together(settings, together, synchronize):
    """The cache settings and whether a process group builds together give one ``CacheOptions``: ranks wait for
    rank 0 only when every rank builds every dataset at the same moment (not lazily) and something may be built."""
    config = IndexedDataConfig(seq_length=8, data_cache_path="/cache", cache_verification="full", **settings)
    options = config.cache_options(together)
    assert options.synchronize is synchronize
    assert options.assume_complete is config.fast_cache_load
    assert options.defer is config.defer_npy_index_mmap
    assert (options.directory, options.verification, options.lock_timeout) == ("/cache", "full", 1800.0)


def test_cache_directory_is_the_configured_one_else_beside_the_prefix():
    """Mid-level datasets keep their entries in ``data_cache_path``, else beside their prefix (as megatron-core);
    without a prefix (mock data) in memory; blends in ``data_cache_path`` or in memory."""
    beside = IndexedDataConfig(seq_length=8).cache_options(False)
    assert beside.directory_for("/data/a_text_document") == "/data/a_text_document/cache/GPTDataset_indices"
    assert beside.directory_for(None) is None and beside.directory is None
    configured = IndexedDataConfig(seq_length=8, data_cache_path="/cache").cache_options(False)
    assert configured.directory_for("/data/a_text_document") == configured.directory_for(None) == "/cache"


def test_integer_settings_are_stored_as_python_ints():
    """numpy integers are accepted as counts and seeds and stored as Python ints (cache keys are JSON)."""
    config = IndexedDataConfig(seq_length=np.int64(16), random_seed=np.uint32(2**32 - 1))
    assert type(config.seq_length) is int and config.seq_length == 16
    assert type(config.random_seed) is int and config.random_seed == 2**32 - 1


def test_nan_surplus_is_refused_naming_the_field():
    """A NaN ``mid_level_dataset_surplus`` is as invalid as a negative one: a ``DataConfigError`` naming the field."""
    with pytest.raises(DataConfigError, match="mid_level_dataset_surplus"):
        IndexedDataConfig(seq_length=8, mid_level_dataset_surplus=float("nan"))


def test_from_mapping_builds_the_same_config():
    """``from_mapping`` of a plain mapping (as YAML gives) equals the keyword construction."""
    values = {"seq_length": 32, "split": "98, 1, 1", "random_seed": 7, "is_dataset_from_mr": True}
    assert IndexedDataConfig.from_mapping(values) == IndexedDataConfig(**values)


def test_from_mapping_with_an_unknown_key_lists_the_valid_keys():
    """An unknown key is a ``DataConfigError`` naming it and listing every valid key."""
    with pytest.raises(DataConfigError) as error:
        IndexedDataConfig.from_mapping({"seq_length": 32, "sequence_length": 32, "shuffle": True})

    message = str(error.value)
    assert "['sequence_length', 'shuffle']" in message
    valid = message.split("valid keys are", 1)[1]
    for field in fields(IndexedDataConfig):
        assert f"'{field.name}'" in valid


# -- split strings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "expected"),
    [
        ("98,1,1", [0.98, 0.01, 0.01]),
        ("1/1/1", [1 / 3, 1 / 3, 1 / 3]),
        ("969, 30, 1", [0.969, 0.03, 0.001]),
        ("5", [1.0, 0.0, 0.0]),
        ("3 1", [0.75, 0.25, 0.0]),
        ("0, 0, 2", [0.0, 0.0, 1.0]),
        (".5,.25,.25", [0.5, 0.25, 0.25]),
    ],
)
def test_parse_split_normalises_and_pads_with_zeros(split, expected):
    """One to three numbers with any separator, normalised to sum 1; missing trailing values are 0."""
    assert parse_split(split) == pytest.approx(expected, abs=1e-15)
    assert len(parse_split(split)) == 3


@pytest.mark.parametrize(
    ("split", "reason"),
    [
        ("", "one to three non-negative numbers"),
        ("train", "one to three non-negative numbers"),
        ("1,2,3,4", "one to three non-negative numbers"),
        ("-1,2,3", "one to three non-negative numbers"),
        ("98, -1, 1", "one to three non-negative numbers"),
        ("0,0,0", "every split a share of 0"),
        ("0", "every split a share of 0"),
    ],
)
def test_parse_split_refuses_invalid_strings_naming_them(split, reason):
    """An empty string, more than three numbers, a negative number or all zeros is a ``DataConfigError`` quoting
    the string."""
    with pytest.raises(DataConfigError, match=reason) as error:
        parse_split(split)
    assert f"split {split!r}" in str(error.value)


@pytest.mark.parametrize(
    ("split", "reason"),
    [
        ("98,1,abc", "part 3 ('abc') is not a non-negative decimal number"),
        ("nan,1,1", "part 1 ('nan') is not a non-negative decimal number"),
        ("inf,1,1", "part 1 ('inf') is not a non-negative decimal number"),
        ("-1,1,1", "part 1 ('-1') is not a non-negative decimal number"),
        ("1e-3, 1, 1", "part 1 ('1e-3') is not a non-negative decimal number"),
        ("98%,1%,1%", "part 1 ('98%') is not a non-negative decimal number"),
        ("98,,1", "part 2 is empty"),
        ("98,1,1,", "part 4 is empty"),
        (",98,1", "part 1 is empty"),
        ("5,4,3,2,1", "has 5 parts"),
        ("9" * 400, "too large"),
    ],
)
def test_parse_split_refuses_what_megatron_reads_silently(split, reason):
    """Where megatron-core drops what is not a number (``"98,1,abc"`` would become ``98, 1, 0``, ``"nan,1,1"``
    ``1, 1, 0``, ``"98,,1"`` ``98, 1, 0``), each case is a ``DataConfigError`` naming ``split``, its value, the
    offending part and the accepted form."""
    with pytest.raises(DataConfigError, match=re.escape(reason)) as error:
        parse_split(split)
    message = str(error.value)
    assert f"split {split!r}" in message
    assert "one to three non-negative numbers separated by commas, such as '98, 1, 1'" in message


@pytest.mark.parametrize("split", [98, 0.5, ["98", "1", "1"], None])
def test_parse_split_refuses_a_value_that_is_not_a_string(split):
    """A YAML number or list as ``split`` is a ``DataConfigError`` naming its type and saying to quote it."""
    with pytest.raises(DataConfigError, match="split must be a string") as error:
        parse_split(split)
    assert repr(split) in str(error.value) and "quote it" in str(error.value)


@pytest.mark.parametrize(
    "split", ["98 , 1 , 1", "  969, 30, 1  ", "98:1:1", "1.5/2.5", "07, 2, 1", "1.,2.,3.", "100", "\t50\t50\n"]
)
def test_split_forms_megatron_accepts_keep_their_megatron_value(split):
    """Separators with spaces around them, colons, a trailing dot, leading zeros or a single number are read as
    megatron-core reads them: the same split matrix, bit for bit."""
    assert split_matrix(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def test_parse_split_refuses_a_malformed_number_naming_the_split():
    """A malformed number such as ``1..2`` is a ``DataConfigError`` quoting the split string."""
    with pytest.raises(DataConfigError, match=r"split '1\.\.2, 1'"):
        parse_split("1..2, 1")


def _random_split_strings(count: int, seed: int) -> list[str]:
    """Split strings of one to three integers or decimals, at least one positive, with assorted separators."""
    rng = np.random.default_rng(seed)
    strings = []
    while len(strings) < count:
        values = []
        for _ in range(rng.integers(1, 4)):
            kind = rng.integers(0, 3)
            if kind == 0:
                values.append(str(int(rng.integers(0, 1000))))
            elif kind == 1:
                values.append(f"{rng.uniform(0, 100):.{int(rng.integers(1, 6))}f}")
            else:
                values.append("0")
        if any(float(v) > 0 for v in values):
            strings.append(str(rng.choice([",", ", ", "/", " ", ";"])).join(values))
    return strings


SPLIT_STRINGS = [
    "98,1,1",
    "1/1/1",
    "969, 30, 1",
    "5",
    "99,1",
    "1,0,0",
    "0,1,0",
    "0,0,1",
    "50,50,0",
    "0.1,0.2,0.7",
    "0.3, 0.3, 0.4",
    "7,2,1",
    "33,33,34",
    "80 10 10",
    "1;1;98",
    "999, 0.5, 0.5",
    *_random_split_strings(60, seed=20_240_601),
]


@pytest.mark.parametrize("split", SPLIT_STRINGS)
def test_split_matrix_equals_megatron(split):
    """``split_matrix`` equals megatron-core's ``convert_split_vector_to_split_matrix(parse_and_normalize_split(s))``
    exactly: the same None entries, the same float bounds bit for bit, and the int 0 as the first bound."""
    ours = split_matrix(split)
    theirs = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))

    assert len(ours) == len(theirs) == 3
    for mine, reference in zip(ours, theirs, strict=True):
        if reference is None:
            assert mine is None
            continue
        assert mine is not None
        for a, b in zip(mine, reference, strict=True):
            assert type(a) is type(b) and a == b, (ours, theirs)
    if ours[0] is not None:
        assert type(ours[0][0]) is int and ours[0][0] == 0


@pytest.mark.parametrize(
    ("split", "num_elements", "expected"),
    [
        ("969,30,1", 1001, [(0, 970), (970, 1000), (1000, 1001)]),
        ("98,1,1", 1000, [(0, 980), (980, 990), (990, 1000)]),
        ("1,1", 5, [(0, 2), (2, 5), None]),  # 2.5 rounds to 2
        ("1,1", 7, [(0, 4), (4, 7), None]),  # 3.5 rounds to 4
        ("1,1,2", 10, [(0, 2), (2, 5), (5, 10)]),  # 2.5 rounds to 2
        ("1,1,2", 6, [(0, 2), (2, 3), (3, 6)]),  # 1.5 rounds to 2
        ("0,1,1", 4, [None, (0, 2), (2, 4)]),
        ("1,1,1", 0, [(0, 0), (0, 0), (0, 0)]),
    ],
)
def test_split_range_rounds_half_to_even(split, num_elements, expected):
    """Element ranges are ``[round(begin * n), round(end * n))`` with Python's round-half-even, as upstream; a None
    bookend gives None."""
    assert [split_range(bookend, num_elements) for bookend in split_matrix(split)] == expected


# -- blends -------------------------------------------------------------------------------------------------------


def _touch_pair(prefix: Path, bin_file: bool = True, idx_file: bool = True) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if bin_file:
        prefix.with_name(prefix.name + ".bin").write_bytes(b"")
    if idx_file:
        prefix.with_name(prefix.name + ".idx").write_bytes(b"")
    return str(prefix)


@pytest.mark.parametrize(
    ("data_path", "prefixes", "weights"),
    [
        ("/data/a_text_document", ("/data/a_text_document",), None),
        ("  /data/a  /data/b\n/data/c ", ("/data/a", "/data/b", "/data/c"), None),
        ("30 /data/a 70 /data/b", ("/data/a", "/data/b"), (30.0, 70.0)),
        (["/data/a", "/data/b"], ("/data/a", "/data/b"), None),
        (["0.3", "/data/a", "0.7", "/data/b"], ("/data/a", "/data/b"), (0.3, 0.7)),
        (["1", "/data/a", "1e-3", "/data/b", "2", "/data/a"], ("/data/a", "/data/b", "/data/a"), (1.0, 1e-3, 2.0)),
        ([Path("/data/a"), " /data/b "], ("/data/a", "/data/b"), None),
    ],
    ids=["prefix", "whitespace_string", "weighted_string", "list", "weighted_list", "raw_weights_kept", "path_objects"],
)
def test_parse_blend_forms(data_path, prefixes, weights):
    """A prefix, a whitespace-separated string, a list of prefixes and a Megatron blend list ``[w, p, w, p, ...]``
    (string or list); weights are kept unnormalised and a prefix may appear twice."""
    assert parse_blend(data_path) == Blend(prefixes, weights)


def test_parse_blend_discovers_complete_pairs_below_a_directory(tmp_path):
    """A directory (given alone, as a path, or as a list entry) stands for every ``.bin``/``.idx`` pair below it,
    recursively, sorted by path; a lone ``.bin`` or ``.idx`` and other files are ignored."""
    root = tmp_path / "shards"
    expected = [
        _touch_pair(root / "a_text_document"),
        _touch_pair(root / "b_text_document"),
        _touch_pair(root / "nested" / "deeper" / "c_text_document"),
        _touch_pair(root / "nested" / "d_text_document"),
    ]
    _touch_pair(root / "only_bin", idx_file=False)
    _touch_pair(root / "nested" / "only_idx", bin_file=False)
    (root / "notes.txt").write_text("not data")
    other = _touch_pair(tmp_path / "other_text_document")

    assert parse_blend(str(root)) == Blend(tuple(sorted(expected)))
    assert parse_blend(root) == Blend(tuple(sorted(expected)))
    assert parse_blend([other, str(root)]) == Blend((other, *sorted(expected)))


def test_parse_blend_directory_without_pairs_is_refused(tmp_path):
    """A directory without a complete pair is a ``DataFileError`` naming it."""
    _touch_pair(tmp_path / "lonely", idx_file=False)
    with pytest.raises(DataFileError, match="no .bin/.idx pairs") as error:
        parse_blend(tmp_path)
    assert str(tmp_path) in str(error.value)


@pytest.mark.parametrize(
    ("data_path", "position", "entry"),
    [
        (["1", "a", "b", "c"], 2, "b"),
        (["a", "1"], 0, "a"),
        (["30", "a", "b"], 2, "b"),
        (["30", "a", "70"], 2, "70"),
        (["30", "a", "70", "40"], 3, "40"),
        ("30 a b 70", 2, "b"),
    ],
)
def test_malformed_blend_list_names_the_entry(data_path, position, entry):
    """A list mixing numbers and prefixes other than ``[w, p, w, p, ...]`` is a ``DataConfigError`` naming the first
    entry that breaks the pattern; it is never reread as a list of prefixes."""
    with pytest.raises(DataConfigError, match="malformed blend list") as error:
        parse_blend(data_path)
    assert f"entry {position} ({entry!r})" in str(error.value)


@pytest.mark.parametrize("weight", ["0", "-1", "-0.5", "nan", "inf"])
def test_blend_weight_must_be_positive_and_finite(weight):
    """A weight that is zero, negative, NaN or infinite is a ``DataConfigError`` naming its prefix."""
    with pytest.raises(DataConfigError, match="must be a positive number") as error:
        parse_blend(["1", "/data/good", weight, "/data/bad"])
    assert "'/data/bad'" in str(error.value) and "/data/good" not in str(error.value)


@pytest.mark.parametrize("data_path", ["", "   ", []], ids=["empty_string", "blank_string", "empty_list"])
def test_empty_data_path_is_refused(data_path, tmp_path, monkeypatch):
    """An empty data path is a ``DataConfigError``; it never stands for the working directory, even one holding
    pairs."""
    _touch_pair(tmp_path / "unrelated_text_document")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataConfigError, match="data_path is empty"):
        parse_blend(data_path)


# -- per-dataset sequences file -----------------------------------------------------------------------------------


def test_load_sequences_per_dataset(tmp_path):
    """The file maps each prefix to ``(sequence_count, document_count)``; without a path there is nothing to load."""
    path = tmp_path / "sequences.json"
    path.write_text(json.dumps({"/data/a": [10, 11], "/data/b": [3, 4]}), encoding="utf-8")

    assert IndexedDataConfig(seq_length=8).load_sequences_per_dataset() is None
    loaded = IndexedDataConfig(seq_length=8, per_dataset_sequences_path=str(path)).load_sequences_per_dataset()
    assert loaded == {"/data/a": (10, 11), "/data/b": (3, 4)}


@pytest.mark.parametrize(("content", "match"), [(None, "does not exist"), ("{not json", "invalid JSON")])
def test_unreadable_sequences_file_is_refused_naming_it(tmp_path, content, match):
    """A missing file or invalid JSON is a ``DataFileError`` naming the file."""
    path = tmp_path / "sequences.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    config = IndexedDataConfig(seq_length=8, per_dataset_sequences_path=str(path))

    with pytest.raises(DataFileError, match=match) as error:
        config.load_sequences_per_dataset()
    assert str(path) in str(error.value)
