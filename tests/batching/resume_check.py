"""One resume check for every stateful loader: stop anywhere, save, restore in a fresh loader, compare."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable

import torch


def plain(batch) -> dict:
    """A batch as plain lists, for equality checks."""
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def roundtrip(state: dict) -> dict:
    """Through ``torch.save``/``torch.load(weights_only=True)``, as a trainer checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def take(loader, count: int) -> list[dict]:
    batches = []
    if count == 0:
        return batches
    for batch in loader:
        batches.append(plain(batch))
        if len(batches) == count:
            break
    return batches


def check_exact_resume(make_loader: Callable, stop_points: Iterable[int]) -> list[dict]:
    """Assert that stopping after k batches and restoring in a new loader gives the uninterrupted batches.

    A negative stop point counts from the end (e.g. -1 stops before the last batch). Returns the uninterrupted
    batches.
    """
    reference = [plain(batch) for batch in make_loader()]
    assert reference, "the loader yielded nothing"
    for stop in stop_points:
        stop = stop % len(reference)
        loader = make_loader()
        head = take(loader, stop)
        state = roundtrip(loader.state_dict())
        restored = make_loader()
        restored.load_state_dict(state)
        tail = [plain(batch) for batch in restored]
        assert head + tail == reference, f"resume after {stop} batches differs"
    return reference
