"""Mixtures of any dataset nodes by weight (``build_mixture.build_mixture_dataset``), in an order planned by
``mixture_order`` and tallied per source by the loaders (``mixture_tally``)."""

from hyper_parallel.data.mixture.build_mixture import MixtureDataset, MixtureSource, build_mixture_dataset
from hyper_parallel.data.mixture.mixture_order import MixtureOrder

__all__ = ["MixtureDataset", "MixtureOrder", "MixtureSource", "build_mixture_dataset"]
