"""Specification of the error families' shared behaviour: placing a config error under its YAML path."""

from __future__ import annotations

import pickle

from hyper_parallel.data.errors import DataConfigError


def test_within_prefixes_the_yaml_path_from_the_inside_out():
    """Each enclosing caller adds its part of the path; the message then starts with the whole path."""
    error = DataConfigError("seq_length must be an integer >= 1, got 0")
    assert error.within("data_config") is error
    error.within("dataset")
    assert str(error) == "dataset.data_config: seq_length must be an integer >= 1, got 0"
    assert error.where == "dataset.data_config"


def test_within_an_empty_path_changes_nothing():
    error = DataConfigError("unknown data_type 'sft'")
    assert str(error.within("")) == "unknown data_type 'sft'" and error.where == ""


def test_a_located_error_pickles_with_its_path():
    """Errors cross process boundaries (DataLoader workers, build barriers) with their path, and can be placed
    further after the trip."""
    error = pickle.loads(pickle.dumps(DataConfigError("split '1,,1': part 2 is empty").within("data_config")))
    assert type(error) is DataConfigError and error.where == "data_config"
    assert str(error.within("dataset")) == "dataset.data_config: split '1,,1': part 2 is empty"
