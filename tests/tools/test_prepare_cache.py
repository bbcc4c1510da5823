"""Specification of ``prepare_cache``: a cache built ahead of time is what training loads, building nothing."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from command_runs import run_command
from indexed.test_index_cache import assert_same_datasets, building_messages, write_corpus

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_config import IndexedDataConfig
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH
from hyper_parallel.data.tools.prepare_cache import (
    default_global_batch_size,
    main,
    num_samples_from_schedule,
    prepare_cache,
)

SETTINGS = {"seq_length": 32, "split": "90, 8, 2", "random_seed": 77}
# --global-batch-size 4 --train-iters 50 --eval-interval 20 --eval-iters 2: train 200, valid (50 // 20 + 1) * 8, test 8
SCHEDULE = ["--global-batch-size", "4", "--train-iters", "50", "--eval-interval", "20", "--eval-iters", "2"]
NUM_SAMPLES = [200, 24, 8]


@pytest.fixture
def corpora(tmp_path) -> tuple[str, str]:
    return (
        write_corpus(tmp_path / "a_text_document", num_documents=250, seed=1),
        write_corpus(tmp_path / "b_text_document", num_documents=400, seed=2),
    )


def _data_path(corpora, kind: str) -> list[str]:
    a, b = corpora
    return {"prefix": [a], "blend": ["30", a, "70", b]}[kind]


def _cli_argv(data_path: list[str], cache, *extra) -> list[str]:
    return [
        "--data-path",
        *data_path,
        "--split",
        SETTINGS["split"],
        "--seq-length",
        SETTINGS["seq_length"],
        "--seed",
        SETTINGS["random_seed"],
        "--tokenizer-name-or-path",
        BUNDLED_TOKENIZER_PATH,
        "--data-cache-path",
        cache,
        *extra,
    ]


# -- the cache is what training loads -----------------------------------------------------------------------------


@pytest.mark.parametrize("defer", [False, True], ids=["fast_cache_load", "fast_cache_load+defer"])
@pytest.mark.parametrize("kind", ["prefix", "blend"])
def test_training_after_prepare_cache_builds_nothing(tmp_path, corpora, tokenizer, capsys, caplog, kind, defer):
    """After the command, training with fast loading builds nothing and gets the datasets of a normal build."""
    data_path, cache = _data_path(corpora, kind), tmp_path / "cache"
    code, out, err = run_command(main, capsys, *_cli_argv(data_path, cache, *SCHEDULE))
    assert code == 0, err
    assert f"cache directory {cache}: " in out and "-GPTDataset-train-description.txt" in out

    caplog.set_level(logging.INFO, logger="hyper_parallel.data")
    training = build_indexed_text_dataset(
        data_path,
        {**SETTINGS, "data_cache_path": str(cache), "fast_cache_load": True, "defer_npy_index_mmap": defer},
        NUM_SAMPLES,
        tokenizer,
    )
    assert building_messages(caplog) == []

    normal = build_indexed_text_dataset(
        data_path, {**SETTINGS, "data_cache_path": str(tmp_path / "n")}, NUM_SAMPLES, tokenizer
    )
    assert len(building_messages(caplog)) > 0
    for got, want in zip(training, normal, strict=True):
        assert_same_datasets(got, want)


def test_weighted_blend_report(tmp_path, corpora, capsys):
    """The command prints the effective values, each split's type and length with its sources, and the files."""
    a, b = corpora
    cache = tmp_path / "cache"
    code, out, _ = run_command(main, capsys, *_cli_argv(["30", a, "70", b], cache, *SCHEDULE))

    assert code == 0
    assert f"data_path                              30 {a} 70 {b}" in out
    assert "global batch size                      4 (--global-batch-size)" in out
    assert "samples                                train 200, valid 24, test 8" in out
    # weighted blends take sum(ceil(N * w)) samples: train 60 + 140, valid ceil(7.2) + ceil(16.8), test 3 + 6
    assert "  train: BlendedDataset, 200 samples" in out
    assert "  valid: BlendedDataset, 25 samples" in out
    assert "  test: BlendedDataset, 9 samples" in out
    assert f"    [0] GPTDataset {a}: " in out and f"    [1] GPTDataset {b}: " in out
    written = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert f"cache directory {cache}: {len(written)} files written" in out
    assert all(f"  {name}\n" in out for name in written)
    assert len([n for n in written if n.endswith("-description.txt")]) == 9  # 3 splits x (2 sources + blend)

    code, out, _ = run_command(main, capsys, *_cli_argv(["30", a, "70", b], cache, *SCHEDULE))
    assert code == 0 and "nothing written, every index was cached already" in out


def test_prepare_cache_function(tmp_path, corpora, tokenizer, caplog):
    """The function reports what it built, turns off the settings that need a cache, and writes once."""
    a, b = corpora
    config = IndexedDataConfig(
        **{**SETTINGS, "split": None},
        train_data_path=a,
        valid_data_path=["1", a, "3", b],
        data_cache_path=str(tmp_path / "cache"),
        fast_cache_load=True,
        defer_npy_index_mmap=True,
    )
    report = prepare_cache(config, tokenizer, [100, 20, None])

    assert report["turned_off"] == ["fast_cache_load", "defer_npy_index_mmap"]
    assert report["num_samples"] == [100, 20, None]
    # a GPTDataset holds whole epochs: at least the samples requested
    assert report["splits"]["train"]["type"] == "GPTDataset" and report["splits"]["train"]["length"] >= 100
    assert report["splits"]["valid"]["type"] == "BlendedDataset" and report["splits"]["valid"]["length"] == 20
    assert report["splits"]["test"] is None
    assert len([n for n in report["files_written"] if n.endswith("-description.txt")]) == 4

    caplog.set_level(logging.INFO, logger="hyper_parallel.data")
    assert prepare_cache(config, tokenizer, [100, 20, None])["files_written"] == []
    training = build_indexed_text_dataset(None, config, [100, 20, None], tokenizer)
    assert building_messages(caplog) == []
    assert len(training[0]) == report["splits"]["train"]["length"] and len(training[1]) == 20


# -- sample counts ------------------------------------------------------------------------------------------------


def test_sample_counts_follow_megatron():
    """train = iters * gbs; valid = (iters // interval + 1) * eval_iters * gbs; test = eval_iters * gbs."""
    assert num_samples_from_schedule(global_batch_size=8, train_iters=100, eval_interval=30, eval_iters=2) == (
        800,
        64,
        16,
    )
    # train_samples fixes the iterations (train_samples // gbs = 12 here)
    assert num_samples_from_schedule(global_batch_size=8, train_samples=100, eval_interval=5, eval_iters=1) == (
        100,
        24,
        8,
    )
    # explicit counts win; a count that cannot be computed is one epoch (None)
    assert num_samples_from_schedule(global_batch_size=8, train_iters=10, eval_iters=3, test_samples=5) == (
        80,
        None,
        5,
    )
    assert num_samples_from_schedule(train_samples=10, valid_samples=0) == (10, 0, None)


def test_default_global_batch_is_micro_batch_times_data_parallel_size():
    assert default_global_batch_size(4, 64) == 256
    assert default_global_batch_size(4, 64, tensor_model_parallel_size=2, pipeline_model_parallel_size=2) == 64
    with pytest.raises(DataConfigError, match="not divisible"):
        default_global_batch_size(4, 6, tensor_model_parallel_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train_iters": 10}, "train samples is unknown"),
        ({"global_batch_size": 8}, "train samples is unknown"),
        ({"global_batch_size": 8, "train_iters": 10, "train_samples": 80}, "not both"),
        ({"global_batch_size": 0, "train_iters": 10}, "global_batch_size must be positive"),
        ({"train_samples": 10, "eval_iters": -1}, "eval_iters must be >= 0"),
    ],
)
def test_sample_count_errors(kwargs, message):
    with pytest.raises(DataConfigError, match=message):
        num_samples_from_schedule(**kwargs)


def test_cli_derives_the_global_batch_from_micro_batch_and_world_size(tmp_path, corpora, capsys):
    """Without --global-batch-size: micro batch 2 x data-parallel size 4 (world size 8, tensor parallel 2)."""
    schedule = ["--micro-batch-size", "2", "--prepare-cache-world-size", "8", "--tensor-model-parallel-size", "2"]
    schedule += ["--train-iters", "10", "--eval-interval", "5", "--eval-iters", "1"]
    code, out, err = run_command(main, capsys, *_cli_argv(_data_path(corpora, "prefix"), tmp_path / "cache", *schedule))

    assert code == 0, err
    assert "8 (micro batch 2 x data-parallel size 4)" in out
    assert "train 80, valid 24, test 8" in out
    assert "  train: GPTDataset, " in out


# -- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--mock-data", "error: mock_data is set, but mock documents are synthetic and have no files"),
        ("--is-dataset-from-mr", "error: is_dataset_from_mr is set, but offline-packed records"),
    ],
)
def test_refuses_what_builds_no_cache(tmp_path, corpora, capsys, flag, message):
    code, out, err = run_command(
        main, capsys, *_cli_argv(_data_path(corpora, "prefix"), tmp_path / "cache", flag, *SCHEDULE)
    )

    assert code == 2
    assert err.startswith(message) and "Traceback" not in err
    assert not (tmp_path / "cache").exists()


def test_missing_data_cache_path_is_refused(corpora, capsys):
    argv = ["--data-path", corpora[0], "--seq-length", "32", "--tokenizer-name-or-path", BUNDLED_TOKENIZER_PATH]
    code, _, err = run_command(main, capsys, *argv, *SCHEDULE)

    assert code == 2
    assert err.startswith("error: data_cache_path (--data-cache-path) is required")


def test_unwritable_cache_directory_is_refused(tmp_path, corpora, capsys):
    """Preparing into a directory that cannot be created or written is an error, not an in-memory build."""
    (tmp_path / "file").write_text("not a directory")
    cache = tmp_path / "file" / "cache"
    code, _, err = run_command(main, capsys, *_cli_argv(_data_path(corpora, "prefix"), cache, *SCHEDULE))

    assert code == 2
    assert err.startswith(f"error: data_cache_path {cache} is not a writable directory")


def test_missing_sample_counts_and_data_files_exit_2(tmp_path, corpora, capsys):
    code, _, err = run_command(
        main, capsys, *_cli_argv(_data_path(corpora, "prefix"), tmp_path / "cache", "--eval-iters", "2")
    )
    assert code == 2 and "the number of train samples is unknown" in err

    code, _, err = run_command(main, capsys, *_cli_argv([str(tmp_path / "missing")], tmp_path / "cache", *SCHEDULE))
    assert code == 2 and f"indexed dataset '{tmp_path / 'missing'}': missing" in err


def test_help_exits_0_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--data-cache-path" in out and "examples:" in out and "--prepare-cache-world-size 64" in out


def test_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.data.tools.prepare_cache", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hp-data prepare-cache")
