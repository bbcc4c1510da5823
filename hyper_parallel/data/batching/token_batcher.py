"""The default packing policy: one pass in arrival order, taking every sample that still fits a token budget.

Owns: ``TextTokenBatcher`` (the dynamic loader's default ``PackingPolicy``), its buffer and its part of a loader
state. Not responsible for: where samples come from or how they survive a restart (the key source, its codec),
packing the chosen samples into tensors (the collators).

Its state (``state['packing']`` of a dynamic loader's state)::

    {"policy": "TextTokenBatcher", "token_budget": int, "min_buffered_samples": int,
     "sequence_multiple": int (absent in states saved before it existed: 1),
     "buffer": the buffered samples, encoded by the key source, in arrival order,
     "buffer_tokens": their cost (checked on load: a changed transform would give another)}
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from hyper_parallel.data.batching.packing_policy import Entry, SampleCodec
from hyper_parallel.data.errors import DataConfigError, DataFileError, ResumeStateError
from hyper_parallel.data.resume_checks import check_state_type, state_field

__all__ = ["TextTokenBatcher"]

_WHERE = "the loader state['packing']"


class TextTokenBatcher:
    """Choose micro-batches from a buffer of samples under a token budget.

    ``pop`` makes one pass over the buffer in arrival order and takes every sample that still fits (the first
    one always: a sample longer than the budget forms its own batch and is never cut). Samples left behind keep
    their order for the next batch. A subclass may charge more than a sample's tokens by overriding ``cost``.

    Args:
        token_budget: most tokens per micro-batch (``micro_batch_size * max_seq_len``).
        min_buffered_samples: samples to hold before a batch is chosen, so that small samples can fill gaps.
        sequence_multiple: each sample is charged its length rounded up to this multiple: the collator pads every
            sequence to it (``pad_each_sequence_to``, for the ``zigzag_thd`` layout), and the budget holds padding.
    """

    def __init__(self, token_budget: int, min_buffered_samples: int, sequence_multiple: int = 1) -> None:
        for name, value in (
            ("token_budget", token_budget),
            ("min_buffered_samples", min_buffered_samples),
            ("sequence_multiple", sequence_multiple),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DataConfigError(f"{name} is {value!r}; use a positive integer")
        self.token_budget = token_budget
        self.min_buffered_samples = min_buffered_samples
        self.sequence_multiple = sequence_multiple
        self._entries: list[tuple[Hashable | None, Mapping, int]] = []  # (key, sample, cost) in arrival order
        self._buffered_cost = 0

    def cost(self, sample: Mapping) -> int:
        return -(-len(sample["input_ids"]) // self.sequence_multiple) * self.sequence_multiple

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable | None, sample: Mapping) -> None:
        cost = self.cost(sample)
        if cost == 0:
            raise DataFileError(f"sample {key!r} has no tokens; a transform must not return empty samples")
        self._entries.append((key, sample, cost))
        self._buffered_cost += cost

    def ready(self) -> bool:
        return len(self._entries) >= self.min_buffered_samples and self._buffered_cost >= self.token_budget

    def pop(self) -> list[Entry]:
        taken, kept, used = [], [], 0
        for position, entry in enumerate(self._entries):
            if not taken or used + entry[2] <= self.token_budget:
                taken.append(entry)
                used += entry[2]
                if used == self.token_budget:
                    kept.extend(self._entries[position + 1 :])
                    break
            else:
                kept.append(entry)
        self._entries = kept
        self._buffered_cost -= used
        return [(key, sample) for key, sample, _ in taken]

    def state_dict(self, codec: SampleCodec) -> dict:
        return {
            "policy": type(self).__name__,
            "token_budget": self.token_budget,
            "min_buffered_samples": self.min_buffered_samples,
            "sequence_multiple": self.sequence_multiple,
            "buffer": codec.encode_samples([(key, sample) for key, sample, _ in self._entries]),
            "buffer_tokens": self._buffered_cost,
        }

    def load_state_dict(self, state: Mapping, codec: SampleCodec) -> None:
        check_state_type(state, Mapping, _WHERE)
        policy = state_field(state, "policy", str, _WHERE)
        if policy != type(self).__name__:
            raise ResumeStateError(
                f"{_WHERE} was saved by the packing policy {policy}, but this loader packs with "
                f"{type(self).__name__}; resume with the same packing_policy, or start without the state"
            )
        saved = {**state, "sequence_multiple": state.get("sequence_multiple", 1)}
        for key in ("token_budget", "min_buffered_samples", "sequence_multiple"):
            if state_field(saved, key, int, _WHERE) != getattr(self, key):
                raise ResumeStateError(
                    f"the state was saved with {key}={saved[key]} but this loader has {getattr(self, key)}; the "
                    "choice of samples per micro-batch depends on it, so resume with the same micro_batch_size, "
                    "max_seq_len, min_buffered_samples and CP layout"
                )
        saved_cost = state_field(state, "buffer_tokens", int, _WHERE)
        entries = codec.decode_samples(state_field(state, "buffer", list, _WHERE), f"{_WHERE}['buffer']")
        costs = [self.cost(sample) for _, sample in entries]
        if sum(costs) != saved_cost:
            raise ResumeStateError(
                f"the restored token buffer holds {sum(costs)} tokens but the state recorded {saved_cost}: the data "
                "files or the transform changed since the state was saved"
            )
        self._entries = [(key, sample, cost) for (key, sample), cost in zip(entries, costs, strict=True)]
        self._buffered_cost = saved_cost

    def __repr__(self) -> str:
        return (
            f"TextTokenBatcher(token_budget={self.token_budget}, min_buffered_samples={self.min_buffered_samples}, "
            f"sequence_multiple={self.sequence_multiple})"
        )
