"""The Online mapping source: a finite, random-access Hugging Face dataset read by index (``streaming=False``).

Owns: ``dataset[index]`` and batched reads over a ``datasets.Dataset`` (straight from its Arrow table when no
feature needs decoding), naming a record in messages, and the identity of the data
(the files' sizes and modification times). Order, DP assignment and resume belong
to the batch sampler (``parallel.batch_sampler``); tokenization to the transform.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.utils.data

from hyper_parallel.data.errors import DataFileError
from hyper_parallel.data.resume_checks import data_identity
from hyper_parallel.data.text.records import data_file_entries

__all__ = ["OnlineMappingDataset"]


class OnlineMappingDataset(torch.utils.data.Dataset):
    """Raw records by index: "give me record 100".

    Args:
        hf_dataset: a ``datasets.Dataset`` (memory-mapped Arrow, cheap to send to worker processes).
        description: where the records come from, used in messages.
        files: the files behind the dataset, whose identity loader states record.
    """

    def __init__(self, hf_dataset, description: str, *, files: Sequence[str | os.PathLike] = ()) -> None:
        self.hf_dataset = hf_dataset
        self.description = description
        self.files = list(files)
        self._identity: dict | None = None
        self._plain_arrow = _reads_as_plain_arrow(hf_dataset)

    def __len__(self) -> int:
        return len(self.hf_dataset)

    def _check_range(self, index: int) -> None:
        if not 0 <= index < len(self.hf_dataset):
            raise DataFileError(
                f"record {index} is out of range for {self.description}, which has {len(self.hf_dataset)} records; "
                "a saved loader state or data_rearrange_map probably belongs to other data"
            )

    def __getitem__(self, index: int) -> dict:
        self._check_range(index)
        return self.hf_dataset[int(index)]

    def records(self, indices: list[int]) -> list[dict]:
        """The records at ``indices``, read in one batch."""
        indices = [int(index) for index in indices]
        if indices and not 0 <= min(indices) <= max(indices) < len(self.hf_dataset):
            self._check_range(next(i for i in indices if not 0 <= i < len(self.hf_dataset)))
        if self._plain_arrow:  # the rows as Python dicts in one Arrow call, what ``datasets`` formats them into
            return self.hf_dataset.data.fast_gather(indices).to_pylist()
        return self.hf_dataset.__getitems__(indices)

    def data_identity(self) -> dict:
        """The files' identity (paths, sizes, modification times), taken when first asked. Not the Hugging Face
        fingerprint: it also changes with the ``datasets`` release, which must not refuse a resume."""
        if self._identity is None:
            self._identity = data_identity(self.description, data_file_entries(self.files))
        return self._identity

    def where(self, index: int) -> str:
        """``record N of <source>``, for messages."""
        return f"record {index} of {self.description}"

    def __repr__(self) -> str:
        return f"OnlineMappingDataset({self.description}, {len(self)} records)"


def _reads_as_plain_arrow(hf_dataset) -> bool:
    """Whether the rows of ``hf_dataset`` are its Arrow table's rows as they are: no index mapping, no output
    format or column selection, and no feature (image, audio...) that ``datasets`` decodes when read."""
    from datasets.features.features import require_decoding

    form = hf_dataset.format
    return (
        getattr(hf_dataset, "_indices", None) is None
        and form["type"] is None
        and form["columns"] in (None, hf_dataset.column_names)
        and not form["output_all_columns"]
        and not any(require_decoding(feature) for feature in hf_dataset.features.values())
    )
