"""The options both loaders take, spelled once: three frozen, validated groups and their flat keyword form.

Owns: ``WorkerOptions`` (the torch DataLoader's worker settings), ``LoaderOptions`` (a ``BatchLayout``, a
``SamplerOptions`` and a ``WorkerOptions``), gathering the flat keyword arguments a YAML ``dataloader`` node or a
Python caller writes (``micro_batch_size: 2``, ``num_workers: 4``...) into them in one place
(``LoaderOptions.from_keywords``), and the signature that lists them on every loader (``takes_loader_options``), so
that ``instantiate`` checks a node's keys and offers runtime facts (``micro_batch_size``, ``dp_rank``, ``seed``...)
by name. Not responsible for: what the options do (the sampler, the key sources, torch's DataLoader), or the
loader-specific options (``max_seq_len``, ``min_buffered_samples``, ``packing_policy``).

Every option is checked when its group is built, so a bad value is a ``DataConfigError`` naming the option, the
value and the fix before any data is read.
"""

from __future__ import annotations

import difflib
import inspect
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any

import torch

from hyper_parallel.data.errors import DataConfigError, require_int
from hyper_parallel.data.parallel.batch_sampler import BatchLayout, SamplerOptions

__all__ = ["BatchLayout", "LoaderOptions", "SamplerOptions", "WorkerOptions", "takes_loader_options"]


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """How the torch DataLoader fetches: batches and resume never depend on these.

    Args:
        num_workers: worker processes that fetch and transform (0: the main process does).
        prefetch_factor: batches each worker fetches ahead (torch's default when None; unused without workers).
        pin_memory: return batches in pinned memory, for faster copies to the GPU.
        persistent_workers: keep the workers between epochs (unused without workers).
        multiprocessing_context: how workers start: ``fork``, ``spawn``, ``forkserver``, a context object, or None
            for the platform's default.
        timeout: seconds to wait for a worker's batch before raising (0: wait as long as it takes).

    Raises:
        DataConfigError: a count that is not an integer in range, a flag that is not a bool, an unknown start
            method, or a negative timeout.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    multiprocessing_context: Any = None
    timeout: float = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_workers", require_int("num_workers", self.num_workers, 0))
        if self.prefetch_factor is not None:
            object.__setattr__(self, "prefetch_factor", require_int("prefetch_factor", self.prefetch_factor, 1))
        for name in ("pin_memory", "persistent_workers"):
            if not isinstance(getattr(self, name), bool):
                raise DataConfigError(
                    f"{name} must be a bool, got {getattr(self, name)!r}; write true or false, unquoted"
                )
        methods = multiprocessing.get_all_start_methods()
        if isinstance(self.multiprocessing_context, str) and self.multiprocessing_context not in methods:
            raise DataConfigError(
                f"multiprocessing_context {self.multiprocessing_context!r} is not a start method of this platform; "
                f"use one of {methods}, or leave it unset for the default"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, Real) or not self.timeout >= 0:
            raise DataConfigError(
                f"timeout must be a number of seconds >= 0 (0 waits as long as a worker takes), got {self.timeout!r}"
            )

    def dataloader_kwargs(self, seed: int) -> dict:
        """The keyword arguments of ``torch.utils.data.DataLoader``; ``seed`` seeds its generator (the workers'
        base seed). Options that only apply to workers are left out without them, as torch requires."""
        kwargs = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "generator": torch.Generator().manual_seed(seed),
        }
        if self.num_workers > 0:
            kwargs.update(
                persistent_workers=self.persistent_workers,
                multiprocessing_context=self.multiprocessing_context,
                timeout=self.timeout,
            )
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


# The option groups, in the order their options appear in a loader's signature.
_GROUPS = {"layout": BatchLayout, "sampler": SamplerOptions, "workers": WorkerOptions}


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Everything a loader is told besides its dataset, collate function and packing settings."""

    layout: BatchLayout = field(default_factory=BatchLayout)
    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    workers: WorkerOptions = field(default_factory=WorkerOptions)

    @classmethod
    def from_keywords(cls, **options) -> LoaderOptions:
        """The groups of the flat options (``micro_batch_size=2, num_workers=4, ...``); unset ones keep their
        defaults.

        Raises:
            DataConfigError: an unknown option (with the closest valid name), or an invalid value.
        """
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            close = difflib.get_close_matches(unknown[0], _OPTION_NAMES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataConfigError(
                f"unknown loader option(s) {unknown}{hint}; the options are {', '.join(_OPTION_NAMES)}"
            )
        return cls(
            **{
                group: kind(**{f.name: options[f.name] for f in fields(kind) if f.name in options})
                for group, kind in _GROUPS.items()
            }
        )


_OPTION_NAMES = tuple(f.name for kind in _GROUPS.values() for f in fields(kind))
_PARAMETERS = [
    inspect.Parameter(
        f.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=f.default,
        annotation=f.type,
    )
    for kind in _GROUPS.values()
    for f in fields(kind)
]


def takes_loader_options(init: Callable) -> Callable:
    """Let ``init``'s ``**options`` stand for the flat loader options: its signature lists them by name.

    ``inspect.signature`` (hence ``instantiate``, ``help`` and editors that ask it) then shows every option with its
    default, a misspelt YAML key is refused with the closest name before anything is built, and runtime facts
    reach the loader by name; the options themselves are gathered by ``LoaderOptions.from_keywords``.
    """
    signature = inspect.signature(init)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    init.__signature__ = signature.replace(parameters=[*own, *_PARAMETERS])
    return init
