"""The seam between the dynamic loader and the policy that chooses the samples of each micro-batch.

Owns: ``PackingPolicy``, what the dynamic loader asks of a policy, and ``SampleCodec``, what a policy may ask of the
key source when it writes its buffered samples into a state and reads them back. Not responsible for: any policy
(``token_batcher.TextTokenBatcher`` is the default), where samples come from (``key_sources``) or packing the
chosen samples into tensors (the collators).

How the dynamic loader drives a policy::

    for each sample, in record order:   policy.put(key, sample)      (the key source names the sample's key)
                                        while policy.ready(): yield collate(policy.pop())
    at the end of the epoch:            while len(policy): yield collate(policy.pop())
    state:                              policy.state_dict(codec) -> an opaque nested dict the loader stores
    restore:                            policy.load_state_dict(state, codec)

The codec is the key source: it knows how its samples survive a restart (a mapping source's record index and
window, re-read and re-transformed on load; a stream's tokens). The policy decides everything else a state holds:
its settings, its buffered samples' order and grouping, what they cost. The loader never reads a policy's state.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from hyper_parallel.data.errors import DataConfigError

__all__ = ["PackingPolicy", "SampleCodec", "checked_policy"]

# What a policy buffers: the key source's key of a sample (None when the sample is its own key) and the sample.
Entry = tuple[Hashable | None, Mapping]


class SampleCodec(Protocol):
    """How buffered samples are written into a state and read back (the key source's business)."""

    def encode_samples(self, entries: Sequence[Entry]) -> list:
        """One plain, JSON-able item per entry, in order."""
        ...

    def decode_samples(self, saved: list, where: str) -> list[Entry]:
        """The entries ``saved`` describes, checked (``where`` names it in a ``ResumeStateError``)."""
        ...


@runtime_checkable
class PackingPolicy(Protocol):
    """Chooses micro-batches from the samples it is given, under a budget it charges per sample.

    Attributes:
        token_budget: the most a micro-batch may cost (``cost`` summed over its samples); a sample that alone
            costs more forms a micro-batch of its own.
    """

    token_budget: int

    def cost(self, sample: Mapping) -> int:
        """What ``sample`` charges against the budget: its tokens, or more for a policy that pads each sequence."""
        ...

    def put(self, key: Hashable | None, sample: Mapping) -> None:
        """Buffer one sample (keys come from the key source and only travel through ``state_dict``)."""
        ...

    def ready(self) -> bool:
        """Whether a micro-batch should be chosen now (before the end of the epoch)."""
        ...

    def pop(self) -> list[Entry]:
        """Choose and remove one micro-batch: its ``(key, sample)`` entries in the order they are packed. Called
        while ``ready()``, and at the end of the epoch until nothing is left; never on an empty policy."""
        ...

    def __len__(self) -> int:
        """The samples buffered."""
        ...

    def state_dict(self, codec: SampleCodec) -> dict:
        """A plain nested dict (safe for ``torch.save``) that restores the policy exactly, buffer included."""
        ...

    def load_state_dict(self, state: Mapping, codec: SampleCodec) -> None:
        """Continue from ``state``, checked whole first (a refused state, ``ResumeStateError``, changes nothing)."""
        ...


def checked_policy(policy) -> PackingPolicy:
    """``policy``, or a ``DataConfigError`` naming what it lacks of ``PackingPolicy``."""
    missing = [name for name in _MEMBERS if not hasattr(policy, name)]
    if missing:
        raise DataConfigError(
            f"packing_policy {policy!r} is not a PackingPolicy: it has no {', '.join(missing)}; give an object with "
            f"{', '.join(_MEMBERS)} (see hyper_parallel.data.batching.packing_policy), or leave packing_policy out "
            "for the default TextTokenBatcher"
        )
    return policy


_MEMBERS = ("token_budget", "cost", "put", "ready", "pop", "__len__", "state_dict", "load_state_dict")
