"""Samples as torch tensors: a view of an Online dataset, whose samples hold numpy arrays.

Owns: turning a sample (a ModelSample, or the list of them an Online record gives) into torch tensors that share
the arrays' memory, and the dataset views that do it when a sample is read (``return_tensors="pt"`` of
``build_online_text_dataset``), for code that reads samples itself, such as a plain ``torch.utils.data.DataLoader``.
Indexed samples are torch tensors already, as megatron-core's are. A view answers every other attribute with the
wrapped dataset's, so the loaders of ``batching``, which read the wrapped dataset's records, give the same batches
over a view as over the dataset. Not responsible for: reading, transforming or batching.

Example::

    dataset = build_online_text_dataset("train.jsonl", {"max_seq_len": 4096}, tokenizer=tok, return_tensors="pt")
    dataset[0][0]["input_ids"]  # a torch.int64 tensor: the first window of record 0
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch.utils.data

from hyper_parallel.data.errors import DataConfigError

__all__ = [
    "RETURN_TENSORS",
    "IterableTorchSamples",
    "TorchSamples",
    "check_return_tensors",
    "to_torch",
    "with_return_tensors",
]

RETURN_TENSORS = ("np", "pt")


def to_torch(sample):
    """``sample`` with every numpy array and scalar as a torch tensor (sharing memory when the array is writable),
    through dicts and lists; other values are returned as they are."""
    if isinstance(sample, np.ndarray):
        return torch.from_numpy(sample if sample.flags.writeable else sample.copy())
    if isinstance(sample, np.generic):
        return torch.tensor(sample.item())
    if isinstance(sample, Mapping):
        return {key: to_torch(value) for key, value in sample.items()}
    if isinstance(sample, list):
        return [to_torch(value) for value in sample]
    return sample


class _View:
    """Answers what the view does not define with the wrapped dataset's attribute."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getattr__(self, name: str):
        if "dataset" not in self.__dict__:  # while unpickling, before __init__'s state is back
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dataset!r})"


class TorchSamples(_View, torch.utils.data.Dataset):
    """A map-style dataset whose samples are read as torch tensors."""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return to_torch(self.dataset[index])

    def __getitems__(self, indices: list) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[index] for index in indices]
        return to_torch(list(samples))


class IterableTorchSamples(_View, torch.utils.data.IterableDataset):
    """An iterable dataset whose samples are yielded as torch tensors."""

    def __iter__(self) -> Iterator:
        for sample in self.dataset:
            yield to_torch(sample)


def check_return_tensors(return_tensors) -> str:
    """``return_tensors`` when it is ``"np"`` or ``"pt"``; otherwise a ``DataConfigError`` naming both."""
    if return_tensors not in RETURN_TENSORS:
        raise DataConfigError(
            f"return_tensors is {return_tensors!r}; use 'np' (numpy arrays, the default) or 'pt' (torch tensors)"
        )
    return return_tensors


def with_return_tensors(datasets, return_tensors: str):
    """``datasets`` (one dataset, or a tuple with None for empty splits) as ``return_tensors`` asks: ``"np"``
    leaves them as they are, ``"pt"`` wraps each in a torch view.

    Raises:
        DataConfigError: another ``return_tensors`` value.
    """
    if check_return_tensors(return_tensors) == "np":
        return datasets
    if isinstance(datasets, tuple):
        return tuple(None if dataset is None else with_return_tensors(dataset, "pt") for dataset in datasets)
    if isinstance(datasets, torch.utils.data.IterableDataset):
        return IterableTorchSamples(datasets)
    return TorchSamples(datasets)
