"""Exception families of ``hyper_parallel.data``, one per concern.

Every message says what went wrong, where (file, record, field), the offending value, and how to fix it.
All three derive from ``ValueError`` so callers that already catch bad input keep working.
"""

from __future__ import annotations

import difflib
import operator

import numpy as np

__all__ = ["DataConfigError", "DataFileError", "ResumeStateError", "require_choice", "require_flag", "require_int"]


class DataFileError(ValueError):
    """A data file (``.idx``/``.bin``, JSONL, Parquet, ...) is missing, malformed or inconsistent."""


class DataConfigError(ValueError):
    """A configuration value is invalid or two settings contradict each other.

    ``where`` is the YAML path of the config node the error is about (``dataset.data_transform``), empty until a
    caller that knows it places the error there with ``within``; the message then starts with it.
    """

    where: str = ""

    def within(self, path: str) -> DataConfigError:
        """Place this error under the YAML path ``path``, in place (keeping its traceback); returns it to re-raise.

        Each enclosing caller adds its own part: ``within("data_config")`` then ``within("dataset")`` gives
        ``"dataset.data_config: <message>"``.
        """
        if path:
            message = str(self)[len(self.where) + 2 :] if self.where else str(self)
            self.where = f"{path}.{self.where}" if self.where else path
            self.args = (f"{self.where}: {message}",)
        return self


class ResumeStateError(ValueError):
    """A saved loader state cannot be restored into the current pipeline."""


def require_int(name: str, value, minimum: int, error: type[ValueError] = DataConfigError) -> int:
    """``value`` as a Python int, or ``error`` when it is not an integer ``>= minimum``."""
    if isinstance(value, bool | np.bool_):  # an int subclass, but always a mistake as a count
        raise error(f"{name} must be an integer >= {minimum}, got the bool {value}")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise error(f"{name} must be an integer >= {minimum}, got {number}")
    return number


def require_choice(name: str, value, choices: tuple[str, ...], meaning: str) -> str:
    """``value`` when it is one of ``choices``; else a ``DataConfigError`` naming the closest one and ``meaning``."""
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataConfigError(f"{name} is {value!r}{hint}; use one of {', '.join(choices)}: {meaning}")


def require_flag(name: str, value) -> bool:
    """``value`` as a bool (numpy's included); else a ``DataConfigError`` naming it and its type."""
    if not isinstance(value, bool | np.bool_):
        raise DataConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return bool(value)
