"""``text_template``: a ``str.format_map`` template that renders a record's fields into the text to tokenize.

Owns: checking a template once (a string, valid ``str.format`` syntax, every field read by name), the record
fields it reads, and rendering a record, with an error that names the field the record lacks. The Online
plaintext transform and offline preparation both use it. Not responsible for: tokenizing the text, or whether a
record that cannot be rendered stops the run or is skipped (the caller decides, and names the record).
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hyper_parallel.data.errors import DataConfigError, DataFileError

__all__ = ["TextTemplate"]

# What rendering a record can raise: a missing field or item, an attribute or index of the wrong type, a format
# spec that does not fit the value ("{n:d}" over a string).
_RENDER_ERRORS = (KeyError, IndexError, AttributeError, TypeError, ValueError)


def _field_names(template: str) -> Iterator[str]:
    """Every replacement field of ``template``, nested ones in format specs included (``"{a:{width}}"``)."""
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is not None:
            yield name
        if spec:
            yield from _field_names(spec)


@dataclass(frozen=True)
class TextTemplate:
    """A checked ``text_template``, e.g. ``"### Instruction:\\n{instruction}\\n\\n### Response:\\n{output}"``.

    Attributes:
        template: the ``str.format_map`` template over a record.
        name: how the user set it (``text_template``, ``--text-template``); every message names it so.
        fields: the record fields it reads, each once, in order of first use (``{meta[title]}`` reads ``meta``).

    Raises:
        DataConfigError: the template is not a string, not valid ``str.format`` syntax, or reads no field by
            name (``{}``, ``{0}`` or no field at all).
    """

    template: str
    name: str = "text_template"
    fields: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str):
            raise DataConfigError(f"{self.name} must be a string, got {type(self.template).__name__}")
        try:
            names = list(_field_names(self.template))
        except ValueError as error:
            raise DataConfigError(
                f"{self.name} {self.template!r} is not a valid str.format template ({error}); write literal braces "
                "as {{ and }}"
            ) from None
        # "title.upper" and "meta[0]" read the record fields "title" and "meta"
        fields = [name.split(".")[0].split("[")[0] for name in names]
        if not fields or any(not name or name[0].isdigit() for name in fields):
            raise DataConfigError(
                f"{self.name} {self.template!r} must read record fields by name, like {{text}}; positional fields "
                "such as {} or {0} are not supported"
            )
        object.__setattr__(self, "fields", tuple(dict.fromkeys(fields)))

    def render(self, record: Mapping) -> str:
        """The template filled in from ``record``.

        Raises:
            DataFileError: the record lacks a field the template reads (the message names the field and the
                record's keys), or a field's value cannot be rendered; the caller adds where the record is.
        """
        try:
            return self.template.format_map(record)
        except _RENDER_ERRORS as error:
            keys = sorted(map(str, record))
            missing = next((name for name in self.fields if name not in record), None)
            if missing is not None:
                raise DataFileError(
                    f"missing key {missing!r} used by {self.name}; the record has keys {keys}"
                ) from None
            raise DataFileError(
                f"{self.name} cannot render the record ({type(error).__name__}: {error}); the record has keys {keys}"
            ) from None
