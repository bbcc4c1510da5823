"""The micro-batch group collator: one optimizer step's samples in, its micro-batches out.

Owns: cutting the samples a plain ``torch.utils.data.DataLoader`` fetched for one rank's optimizer step
(``batch_size = global_batch_size / dp_world_size``) into ``num_micro_batches`` equal groups, in order, and
collating each with a micro-batch collator (``build_indexed_collate_fn``, ``build_online_text_collate_fn``, or any
callable). It is the step-at-a-time form of what ``FixedBatchDataLoader`` delivers a micro-batch at a time: the same
samples in the same micro-batches. Not responsible for: which samples a step holds (the DataLoader's sampler) or
the collation itself.

Example::

    num_micro_batches = calculate_num_micro_batches(global_batch_size, micro_batch_size, dp_world_size)
    loader = torch.utils.data.DataLoader(
        train, batch_size=num_micro_batches * micro_batch_size,
        collate_fn=MicroBatchGroupCollator(num_micro_batches, build_indexed_collate_fn(tokenizer)),
    )
    for micro_batches in loader:  # one optimizer step: a list of num_micro_batches Batch objects
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch.utils.data import default_collate

from hyper_parallel.data.errors import DataConfigError, DataFileError, require_int

__all__ = ["MicroBatchGroupCollator"]


def _one_sample(item, index: int):
    """A sample, or the single ModelSample of an Online record (a one-element list)."""
    if isinstance(item, (list, tuple)):
        if len(item) != 1:
            raise DataFileError(
                f"sample {index} of the step is a record of {len(item)} ModelSamples (a long text cut into windows, or "
                "none when rejected), so the step cannot hold a fixed number of samples; read such a source with "
                "FixedBatchDataLoader or DynamicBatchDataLoader, which handle one-to-many records"
            )
        item = item[0]
    if not isinstance(item, Mapping):
        raise DataFileError(f"sample {index} of the step is a {type(item).__name__}, not a mapping of fields")
    return item


class MicroBatchGroupCollator:
    """Collate one optimizer step's samples into ``num_micro_batches`` micro-batches (a list, in sample order).

    Picklable when ``collate_fn`` is, so DataLoader workers can run it.

    Args:
        num_micro_batches: micro-batches per optimizer step on this rank (``calculate_num_micro_batches``).
        collate_fn: collates one micro-batch's samples; torch's ``default_collate`` when None.

    Raises:
        DataConfigError: a count that is not a positive integer, or a ``collate_fn`` that is not callable.
    """

    def __init__(self, num_micro_batches: int, collate_fn: Callable[[Sequence], object] | None = None) -> None:
        self.num_micro_batches = require_int("num_micro_batches", num_micro_batches, 1)
        if collate_fn is not None and not callable(collate_fn):
            raise DataConfigError(f"collate_fn must be callable, got {type(collate_fn).__name__} {collate_fn!r}")
        self.collate_fn = default_collate if collate_fn is None else collate_fn

    def __call__(self, samples: Sequence) -> list:
        """The step's micro-batches.

        Raises:
            DataConfigError: no samples, or a count that ``num_micro_batches`` does not divide (the DataLoader's
                ``batch_size`` must be ``num_micro_batches x micro_batch_size``; keep ``drop_last=True``).
            DataFileError: a record with other than one ModelSample, or a sample that is not a mapping.
        """
        count = len(samples)
        if count == 0 or count % self.num_micro_batches:
            raise DataConfigError(
                f"a step of {count} samples cannot be cut into {self.num_micro_batches} equal micro-batches; set the "
                f"DataLoader's batch_size to num_micro_batches x micro_batch_size ({self.num_micro_batches} x your "
                "micro_batch_size) and drop_last=True, so that every step is whole"
            )
        samples = [_one_sample(item, index) for index, item in enumerate(samples)]
        size = count // self.num_micro_batches
        return [self.collate_fn(samples[start : start + size]) for start in range(0, count, size)]

    def __repr__(self) -> str:
        return f"MicroBatchGroupCollator(num_micro_batches={self.num_micro_batches}, collate_fn={self.collate_fn!r})"
