"""``text_template``: a ``str.format_map`` template that renders a record's fields into the text to tokenize.

Owns: checking a template once (a string, valid ``str.format`` syntax, every field read by name, no private
attribute such as ``{text.__class__}``, no width or precision past ``FORMAT_WIDTH_LIMIT``), the record fields it
reads, and rendering a record, with an error that names the field the record lacks. A width taken from the record
(``{text:>{width}}``) is checked as each record is rendered, before the text is built. The Online
plaintext transform and offline preparation both use it. Not responsible for: tokenizing the text, or whether a
record that cannot be rendered stops the run or is skipped (the caller decides, and names the record).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hyper_parallel.data.errors import DataConfigError, DataFileError

__all__ = ["FORMAT_WIDTH_LIMIT", "TextTemplate"]

# The widest field (and the longest precision) a template may ask for: far above any record's text, far below what
# would exhaust a host's memory ("{text:>3000000000}" would build a 3 GB string).
FORMAT_WIDTH_LIMIT = 1 << 20

# The width and the precision of a standard format spec ("<10", "08.3f", ">{width}" once filled in).
_SPEC_NUMBERS = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")

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


def _format_specs(template: str) -> Iterator[str]:
    """The format spec of every replacement field of ``template``, as written (nested fields unfilled)."""
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is not None and spec:
            yield spec


def _check_spec(spec: str, name: str, error: type[Exception]) -> None:
    """Refuse a format spec whose width or precision passes ``FORMAT_WIDTH_LIMIT``, before anything is built."""
    match = _SPEC_NUMBERS.match(spec)
    widest = max((int(number) for number in match.groups() if number), default=0)
    if widest > FORMAT_WIDTH_LIMIT:
        raise error(
            f"{name} asks for a field {widest:,} characters wide (format spec {spec!r}), past the limit of "
            f"{FORMAT_WIDTH_LIMIT:,}; use a smaller width or precision"
        )


class _BoundedFormatter(string.Formatter):
    """``str.format_map`` for templates whose widths come from the record: each filled-in spec is checked first."""

    def __init__(self, name: str) -> None:
        self.name = name

    def format_field(self, value, format_spec: str):
        _check_spec(format_spec, self.name, DataFileError)
        return super().format_field(value, format_spec)


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
    _formatter: _BoundedFormatter | None = field(init=False, repr=False, compare=False)

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
        private = next((name for name in names if re.search(r"\.\s*_", name)), None)
        if private is not None:
            raise DataConfigError(
                f"{self.name} {self.template!r} reads the private attribute {{{private}}}, which would show the "
                "program's internals instead of the record's data; read record fields and their items, like "
                "{meta[title]}"
            )
        specs = list(_format_specs(self.template))
        for spec in specs:
            if "{" not in spec:
                _check_spec(spec, self.name, DataConfigError)
        # a width from the record is checked as each record is rendered
        formatter = _BoundedFormatter(self.name) if any("{" in spec for spec in specs) else None
        object.__setattr__(self, "_formatter", formatter)
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
            if self._formatter is not None:
                return self._formatter.vformat(self.template, (), record)
            return self.template.format_map(record)
        except DataFileError:  # a width from the record past the limit, already named
            raise
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
