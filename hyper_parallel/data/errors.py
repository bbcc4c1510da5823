"""Exception families of ``hyper_parallel.data``, one per concern.

Every message says what went wrong, where (file, record, field), the offending value, and how to fix it.
All three derive from ``ValueError`` so callers that already catch bad input keep working.
"""

from __future__ import annotations

__all__ = ["DataConfigError", "DataFileError", "ResumeStateError"]


class DataFileError(ValueError):
    """A data file (``.idx``/``.bin``, JSONL, Parquet, ...) is missing, malformed or inconsistent."""


class DataConfigError(ValueError):
    """A configuration value is invalid or two settings contradict each other."""


class ResumeStateError(ValueError):
    """A saved loader state cannot be restored into the current pipeline."""
