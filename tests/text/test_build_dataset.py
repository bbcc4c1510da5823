"""Specification of ``build_indexed_text_dataset`` on bad input: every mistake is a ``DataConfigError`` or
``DataFileError`` that names what is wrong (the prefix, the key, the source and its counts), never a hang; and the
accepted forms of ``data_config``, ``tokenizer`` and per-split paths. Also the arguments of
``build_online_text_dataset``: errors in ``data_config`` or a ``data_transform`` mapping name that key."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from indexed.test_index_cache import assert_same_datasets, write_corpus
from indexed.test_indexed_pretrain_dataset import SEQ_LENGTH, build_splits, packed_records, write_records
from omegaconf import OmegaConf

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.indexed.indexed_pretrain_dataset import GPTDataset
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

SETTINGS = {"seq_length": SEQ_LENGTH, "split": "90, 8, 2"}
SIZES = [100, 10, 5]

YAML_CONFIG = """
seq_length: 16
split: 90, 8, 2
random_seed: 4321
mid_level_dataset_surplus: 0.01
add_extra_token_to_sequence: true
"""


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(tmp_path / "corpus_text_document", num_documents=120, seed=31)


def cached(tmp_path: Path, name: str = "cache", **settings) -> dict:
    """``SETTINGS`` with its own cache directory and ``settings``."""
    return {**SETTINGS, "data_cache_path": str(tmp_path / name), **settings}


def raises_within(seconds: float, call: Callable[[], object], error: type[Exception]) -> Exception:
    """Run ``call`` in a daemon thread and return the ``error`` it raises; fail if it is still running after
    ``seconds`` (a hang) or ends any other way."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except Exception as caught:  # handed to the test
            outcome["error"] = caught

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    assert isinstance(outcome.get("error"), error), f"expected {error.__name__}, got {outcome}"
    return outcome["error"]


# -- data paths ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["single", "in_blend", "per_split"])
def test_missing_prefix_is_named(tmp_path, corpus, tokenizer, position):
    """A prefix without its ``.bin``/``.idx`` is a ``DataFileError`` naming it, alone, in a blend list or as a
    per-split path."""
    missing = str(tmp_path / "missing_text_document")
    data_path, settings = {
        "single": (missing, {}),
        "in_blend": (["40", corpus, "60", missing], {}),
        "per_split": (None, {"train_data_path": corpus, "valid_data_path": missing}),
    }[position]

    with pytest.raises(DataFileError) as error:
        build_indexed_text_dataset(data_path, cached(tmp_path, **settings), SIZES, tokenizer)
    assert f"'{missing}'" in str(error.value)


def test_data_path_is_required_without_mock_or_per_split_paths(tokenizer):
    """No ``data_path``, no ``mock_data`` and no per-split path is a ``DataConfigError`` naming all three options."""
    with pytest.raises(DataConfigError) as error:
        build_indexed_text_dataset(None, SETTINGS, SIZES, tokenizer)
    for name in ("data_path", "mock_data", "train/valid/test_data_path"):
        assert name in str(error.value)


def test_split_is_required_with_data_path(corpus, tokenizer):
    """``split: None`` with a ``data_path`` is a ``DataConfigError`` naming ``split``."""
    with pytest.raises(DataConfigError, match="split is required with data_path"):
        build_indexed_text_dataset(corpus, {**SETTINGS, "split": None}, SIZES, tokenizer)


def test_per_split_path_for_train_only(tmp_path, corpus, tokenizer):
    """With only ``train_data_path`` the result is ``(train, None, None)``; train uses the whole prefix, as
    ``split: "1, 0, 0"`` would."""
    train, valid, test = build_indexed_text_dataset(
        None, cached(tmp_path, "per_split", split=None, train_data_path=corpus), [150, None, None], tokenizer
    )

    assert type(train) is GPTDataset and valid is None and test is None
    whole = build_indexed_text_dataset(corpus, cached(tmp_path, "whole", split="1, 0, 0"), [150, None, None], tokenizer)
    assert_same_datasets(train, whole[0])


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ([-1, None, None], ["train_valid_test_num_samples[0] (train samples)", "-1"]),
        ([100, True, None], ["train_valid_test_num_samples[1] (valid samples)", "bool True"]),
        ([100, 10, 2.5], ["train_valid_test_num_samples[2] (test samples)", "2.5"]),
        ([100, "10", 5], ["train_valid_test_num_samples[1] (valid samples)", "'10'"]),
        ("100", ["train_valid_test_num_samples must be a list of three sample counts", "'100'"]),
        (100, ["train_valid_test_num_samples must be a list of three sample counts", "100"]),
    ],
    ids=["negative", "bool", "float", "string_entry", "string", "number"],
)
def test_sample_counts_out_of_range_are_named(corpus, tokenizer, sizes, named):
    """A sample count that is negative, a bool, a float or a string, or sizes that are not a list, is a
    ``DataConfigError`` naming the entry and its split."""
    with pytest.raises(DataConfigError) as error:
        build_indexed_text_dataset(corpus, SETTINGS, sizes, tokenizer)
    for text in named:
        assert text in str(error.value)


def test_sample_counts_accept_zero_none_and_numpy_integers(tmp_path, corpus, tokenizer):
    """0 samples and numpy integers are valid counts, stored as Python ints (cache keys are JSON)."""
    splits = build_indexed_text_dataset(corpus, cached(tmp_path), np.array([40, 0, 3]), tokenizer)
    assert [split.num_samples for split in splits] == [40, 0, 3]
    assert all(type(split.num_samples) is int for split in splits)


@pytest.mark.parametrize("sizes", [[100, 10], [100, 10, 5, 1], []])
def test_sizes_must_have_three_entries(corpus, tokenizer, sizes):
    """``train_valid_test_num_samples`` of another length than three is a ``DataConfigError`` quoting it."""
    with pytest.raises(DataConfigError, match="must have three entries") as error:
        build_indexed_text_dataset(corpus, SETTINGS, sizes, tokenizer)
    assert str(sizes) in str(error.value)


def test_second_build_with_the_default_cache_location(corpus, tokenizer):
    """Without ``data_cache_path`` the indices are cached beside the data; building again with the same
    ``data_path`` reads that cache and returns the same datasets."""
    first = build_indexed_text_dataset(corpus, SETTINGS, SIZES, tokenizer)
    second = build_indexed_text_dataset(corpus, SETTINGS, SIZES, tokenizer)

    for got, want in zip(second, first, strict=True):
        assert_same_datasets(got, want)


# -- data_config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["yaml_dict", "omegaconf"])
def test_yaml_mapping_data_config(tmp_path, corpus, tokenizer, form):
    """A ``data_config`` mapping as YAML gives it (a plain dict or an OmegaConf ``DictConfig``) builds the same
    datasets as the equivalent ``IndexedDataConfig``."""
    values = {**yaml.safe_load(YAML_CONFIG), "data_cache_path": str(tmp_path / form)}
    mapping = values if form == "yaml_dict" else OmegaConf.create(values)

    from_mapping = build_indexed_text_dataset(corpus, mapping, SIZES, tokenizer)

    config = IndexedDataConfig(**{**values, "data_cache_path": str(tmp_path / "typed")})
    assert config.split == "90, 8, 2" and config.random_seed == 4321
    for got, want in zip(from_mapping, build_indexed_text_dataset(corpus, config, SIZES, tokenizer), strict=True):
        assert_same_datasets(got, want)


def test_unknown_data_config_key_is_refused(corpus, tokenizer):
    """An unknown ``data_config`` key is a ``DataConfigError`` naming it and listing the valid keys."""
    with pytest.raises(DataConfigError) as error:
        build_indexed_text_dataset(corpus, {**SETTINGS, "seq_len": 16}, SIZES, tokenizer)
    assert "['seq_len']" in str(error.value) and "'seq_length'" in str(error.value)


@pytest.mark.parametrize(("data_config", "match"), [(None, "data_config is required"), ([16], "got list")])
def test_data_config_must_be_given_as_a_mapping(corpus, tokenizer, data_config, match):
    """A missing ``data_config``, or one that is neither a mapping nor an ``IndexedDataConfig``, is a
    ``DataConfigError``."""
    with pytest.raises(DataConfigError, match=match):
        build_indexed_text_dataset(corpus, data_config, SIZES, tokenizer)


# -- tokenizer ----------------------------------------------------------------------------------------------------


def test_tokenizer_is_required(corpus, tokenizer):
    """``tokenizer=None`` is a ``DataConfigError`` saying a tokenizer is required."""
    with pytest.raises(DataConfigError, match="a tokenizer is required"):
        build_indexed_text_dataset(corpus, SETTINGS, SIZES, None)


def test_tokenizer_given_as_a_path_string(tmp_path, corpus, tokenizer):
    """The path of a local tokenizer, as a string, builds the same datasets as the loaded tokenizer."""
    by_path = build_indexed_text_dataset(corpus, cached(tmp_path, "by_path"), SIZES, str(BUNDLED_TOKENIZER_PATH))
    loaded = build_indexed_text_dataset(corpus, cached(tmp_path, "loaded"), SIZES, tokenizer)

    for got, want in zip(by_path, loaded, strict=True):
        assert_same_datasets(got, want)


def test_tokenizer_given_as_a_path_object(tmp_path, corpus, tokenizer):
    """A ``pathlib.Path`` to a local tokenizer works as its string does."""
    by_path = build_indexed_text_dataset(corpus, cached(tmp_path, "by_path"), SIZES, BUNDLED_TOKENIZER_PATH)
    loaded = build_indexed_text_dataset(corpus, cached(tmp_path, "loaded"), SIZES, tokenizer)

    for got, want in zip(by_path, loaded, strict=True):
        assert_same_datasets(got, want)


# -- blends -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight", ["0", "-2", "0.0"])
def test_blend_weight_zero_or_negative_names_the_source(tmp_path, corpus, tokenizer, weight):
    """A blend weight of 0 or below is a ``DataConfigError`` naming the source it belongs to."""
    other = write_corpus(tmp_path / "other_text_document", num_documents=50, seed=32)

    with pytest.raises(DataConfigError, match="must be a positive number") as error:
        build_indexed_text_dataset(["1", corpus, weight, other], cached(tmp_path), SIZES, tokenizer)
    assert f"'{other}'" in str(error.value) and f"'{corpus}'" not in str(error.value)


def write_documents_of_total(prefix: Path, total: int) -> str:
    """A pair of three documents holding exactly ``total`` tokens."""
    third = total // 3
    lengths = np.array([third, third, total - 2 * third])
    return write_records(prefix, np.split(np.arange(total) % 8000 + 2, np.cumsum(lengths)[:-1]))


# Weights 1 : 1 : 5 over 15 samples give per-source targets ceil(15 * w) = [3, 3, 11] and a blend of 17 samples, of
# which the greedy schedule takes 12 from the third source: one more than its target.
BLEND_WEIGHTS = ("1", "1", "5")
TOO_SMALL = 2


@pytest.mark.parametrize("kind", ["documents", "packed"])
def test_source_too_small_for_its_share_is_named(tmp_path, tokenizer, kind):
    """With ``mid_level_dataset_surplus: 0`` a source built with exactly its target (11 samples) is asked for 12 by
    the blend: a ``DataConfigError`` naming the source, the split, its sample count and the need; a surplus that
    covers the extra sample fixes it."""
    if kind == "documents":
        sources = [
            write_corpus(tmp_path / "a_text_document", num_documents=60, seed=33),
            write_corpus(tmp_path / "b_text_document", num_documents=60, seed=34),
            # 11 * S + 1 tokens: one epoch holds exactly the 11 samples of its target
            write_documents_of_total(tmp_path / "small_text_document", 11 * SEQ_LENGTH + 1),
        ]
    else:
        sources = [
            write_records(tmp_path / f"{name}_text_document", packed_records(40, seed=35 + k))
            for k, name in enumerate(("a", "b", "small"))
        ]
    data_path = [value for weight, prefix in zip(BLEND_WEIGHTS, sources, strict=True) for value in (weight, prefix)]
    settings = {"split": "1, 0, 0", "mid_level_dataset_surplus": 0.0, "is_dataset_from_mr": kind == "packed"}

    with pytest.raises(DataConfigError) as error:
        build_splits(data_path, tokenizer, [15, None, None], **settings, data_cache_path=str(tmp_path / "cache"))
    message = str(error.value)
    assert f"blend source {TOO_SMALL} ({sources[TOO_SMALL]}, train split)" in message
    assert "has 11 samples but the blend needs 12" in message and "mid_level_dataset_surplus" in message

    settings["mid_level_dataset_surplus"] = 0.1
    train = build_splits(data_path, tokenizer, [15, None, None], **settings, data_cache_path=str(tmp_path / "cache"))[0]
    assert len(train) == 17 and int(np.sum(np.asarray(train.dataset_index) == TOO_SMALL)) == 12


# -- splits without tokens ----------------------------------------------------------------------------------------


def test_samples_from_a_split_without_tokens_are_refused(tmp_path, tokenizer):
    """Requesting samples from a split whose documents are all empty is a ``DataConfigError`` naming the prefix and
    the split, raised at once (megatron-core loops forever here)."""
    prefix = write_corpus(tmp_path / "tail_text_document", num_documents=90, seed=36, empty_tail=10)

    error = raises_within(
        30,
        lambda: build_splits(prefix, tokenizer, [50, None, 5], split="90, 0, 10", data_cache_path=str(tmp_path)),
        DataConfigError,
    )
    assert "holds no tokens" in str(error) and prefix in str(error) and "test split" in str(error)


def test_unweighted_blend_with_an_empty_split_is_refused(tmp_path, tokenizer):
    """An unweighted blend whose source has no samples in a split is a ``DataConfigError``, raised at once."""
    full = write_corpus(tmp_path / "full_text_document", num_documents=90, seed=37)
    tail = write_corpus(tmp_path / "tail_text_document", num_documents=90, seed=38, empty_tail=10)

    raises_within(
        30,
        lambda: build_splits([full, tail], tokenizer, None, split="90, 0, 10", data_cache_path=str(tmp_path)),
        DataConfigError,
    )


def test_unweighted_blend_with_an_empty_split_names_the_source(tmp_path, tokenizer):
    """The error for an unweighted blend source without samples in a split names that source and split."""
    full = write_corpus(tmp_path / "full_text_document", num_documents=90, seed=37)
    tail = write_corpus(tmp_path / "tail_text_document", num_documents=90, seed=38, empty_tail=10)

    with pytest.raises(DataConfigError) as error:
        build_splits([full, tail], tokenizer, None, split="90, 0, 10", data_cache_path=str(tmp_path))
    assert tail in str(error.value) and "test" in str(error.value)


# -- seq_length against the data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [None, [10, None, None]], ids=["one_epoch", "requested"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_seq_length_larger_than_every_split_is_refused(tmp_path, tokenizer, sizes, lazy):
    """A ``seq_length`` no split can fill is a ``DataConfigError`` naming seq_length, each split's token count and the
    largest valid seq_length, raised before any index is built (one-epoch splits would be empty; requested samples
    would repeat the split many times over, and a huge seq_length would exhaust memory)."""
    prefix = write_documents_of_total(tmp_path / "small_text_document", 300)
    config = {"seq_length": 10**9, "split": "90, 5, 5", "data_cache_path": str(tmp_path / "cache")}

    def build():
        splits = build_indexed_text_dataset(prefix, {**config, "data_lazy_load": lazy}, sizes, tokenizer)
        return [len(split) for split in splits]  # a lazy build opens the data here

    error = raises_within(30, build, DataConfigError)
    message = str(error)
    assert f"seq_length {10**9} is larger than every split of {prefix}" in message
    assert "needs 1000000001 tokens" in message and "train 300, valid 0, test 0 tokens" in message
    assert "lower seq_length to at most 299" in message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_seq_length_larger_than_a_per_split_source_is_refused(tmp_path, corpus, tokenizer):
    """A per-split source shorter than one sample is refused the same way, naming that source."""
    small = write_documents_of_total(tmp_path / "small_text_document", 20)
    settings = cached(tmp_path, seq_length=32, split=None, train_data_path=corpus, valid_data_path=small)

    with pytest.raises(DataConfigError, match=f"larger than every split of {small}: .* valid 20 tokens"):
        build_indexed_text_dataset(None, settings, [20, 1, None], tokenizer)


def test_seq_length_that_fits_one_split_builds(tmp_path, tokenizer):
    """One split holding a sample's tokens is enough: the others may be smaller, as in megatron-core."""
    prefix = write_documents_of_total(tmp_path / "small_text_document", 300)
    config = {"seq_length": 200, "split": "90, 5, 5", "data_cache_path": str(tmp_path / "cache")}

    train, valid, test = build_indexed_text_dataset(prefix, config, None, tokenizer)
    assert len(train) == 1 and len(valid) == 0 and len(test) == 0


# -- build_online_text_dataset arguments -------------------------------------------------------------------------


@pytest.fixture
def online_jsonl(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(f'{{"text": "record {i}"}}' for i in range(4)) + "\n", encoding="utf-8")
    return str(path)


PLAINTEXT = {"data_type": "plaintext", "max_seq_len": 16}


@pytest.mark.parametrize(
    ("data_transform", "data_config", "start", "named"),
    [
        ({**PLAINTEXT, "max_seq_length": 16}, None, "data_transform: ", ["'max_seq_length'", "'max_seq_len'"]),
        ({**PLAINTEXT, "data_type": "plain"}, None, "data_transform: ", ["unknown data_type 'plain'", "'plaintext'"]),
        ({**PLAINTEXT, "text_keys": 5}, None, "data_transform: ", ["text_keys must be", "5"]),
        ({**PLAINTEXT, "append_eos": "false"}, None, "data_transform: ", ["append_eos", "'false'", "true or false"]),
        (PLAINTEXT, {"shuffle": True}, "data_config: ", ["unknown data_config keys ['shuffle']", "dataset_type"]),
        (PLAINTEXT, {"dataset_type": "map"}, "data_config: ", ["dataset_type is 'map'", "'mapping'"]),
        (PLAINTEXT, {"shuffle_buffer_size": True}, "data_config: ", ["shuffle_buffer_size is True", ">= 0"]),
        (PLAINTEXT, [("dataset_type", "mapping")], "", ["data_config must be a mapping", "got list"]),
        ("plaintext", None, "", ["data_transform must be a transform or a mapping", "'plaintext'"]),
    ],
    ids=[
        "unknown_option",
        "unknown_data_type",
        "text_keys_type",
        "quoted_flag",
        "unknown_key",
        "dataset_type",
        "buffer_size_bool",
        "config_not_a_mapping",
        "transform_not_callable",
    ],
)
def test_online_argument_errors_name_their_key(online_jsonl, tokenizer, data_transform, data_config, start, named):
    """A ``DataConfigError`` in a ``data_transform`` mapping or in ``data_config`` starts with that argument's name
    (``instantiate`` adds the node's path in front: ``dataset.data_config: ...``) and names the value and the fix."""
    with pytest.raises(DataConfigError) as error:
        build_online_text_dataset(online_jsonl, data_transform, data_config, tokenizer)
    message = str(error.value)
    assert message.startswith(start) and not message[len(start) :].startswith(("data_config: ", "data_transform: "))
    for text in named:
        assert text in message


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7"])
def test_online_seed_must_be_a_non_negative_integer(online_jsonl, tokenizer, seed):
    """The seed of the stream's shuffle is an integer >= 0; anything else is a ``DataConfigError`` naming it."""
    with pytest.raises(DataConfigError, match=r"^seed must be an integer >= 0"):
        build_online_text_dataset(online_jsonl, PLAINTEXT, {"dataset_type": "iterable"}, tokenizer, seed=seed)
