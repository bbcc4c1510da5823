"""Specification of ``text_template``: checked once, the fields it reads, and rendering a record with errors that
name the missing field and the record's keys. The Online plaintext transform and offline preparation share it."""

from __future__ import annotations

import pickle

import pytest

from hyper_parallel.data.errors import DataConfigError, DataFileError
from hyper_parallel.data.text.text_template import FORMAT_WIDTH_LIMIT, TextTemplate


@pytest.mark.parametrize(
    ("template", "fields"),
    [
        ("{title}\n\n{text}", ("title", "text")),
        ("{text} and {text} again", ("text",)),
        ("{meta[title]}: {body.strip}", ("meta", "body")),
        ("{text:>{width}}", ("text", "width")),
        ("{{literal}} {text}", ("text",)),
    ],
)
def test_fields_are_the_record_fields_read_each_once(template, fields):
    """Item and attribute access read their base field; nested fields of a format spec count; literal braces do
    not."""
    assert TextTemplate(template).fields == fields


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (42, "text_template must be a string, got int"),
        ("{unclosed", "text_template '{unclosed' is not a valid str.format template"),
        ("no fields at all", "must read record fields by name, like {text}"),
        ("{}", "positional fields such as {} or {0} are not supported"),
        ("{0} and {1}", "positional fields such as {} or {0} are not supported"),
        ("{[0]}", "positional fields such as {} or {0} are not supported"),
    ],
)
def test_a_template_that_reads_no_named_field_is_a_config_error(template, message):
    with pytest.raises(DataConfigError) as raised:
        TextTemplate(template)
    assert message in str(raised.value)


def test_messages_name_the_template_as_the_user_set_it():
    with pytest.raises(DataConfigError, match=r"^--text-template '\{\}' must read"):
        TextTemplate("{}", "--text-template")
    with pytest.raises(DataFileError, match=r"^missing key 'title' used by --text-template"):
        TextTemplate("{title}", "--text-template").render({"text": "x"})


def test_render_fills_the_fields_in():
    template = TextTemplate("### {title}\n{text:.3}")
    assert template.render({"title": "Hi", "text": "abcdef", "other": 1}) == "### Hi\nabc"


def test_a_missing_field_names_the_field_and_the_record_keys():
    with pytest.raises(DataFileError) as raised:
        TextTemplate("{instruction}\n{output}").render({"instruction": "Hi", "response": "Hello"})
    assert str(raised.value) == (
        "missing key 'output' used by text_template; the record has keys ['instruction', 'response']"
    )


@pytest.mark.parametrize(
    ("template", "record", "error"),
    [
        ("{meta[title]}", {"meta": {"name": "x"}}, "KeyError: 'title'"),
        ("{items[3]}", {"items": [1]}, "IndexError: list index out of range"),
        ("{text.missing}", {"text": "x"}, "AttributeError: 'str' object has no attribute 'missing'"),
        ("{count:d}", {"count": "seven"}, "ValueError: Unknown format code 'd' for object of type 'str'"),
        ("{meta[0]}", {"meta": None}, "TypeError: 'NoneType' object is not subscriptable"),
    ],
)
def test_a_field_whose_value_cannot_be_rendered_names_the_error_and_the_keys(template, record, error):
    """Every failure of ``str.format_map`` is a DataFileError about the record, never a bare traceback."""
    with pytest.raises(DataFileError) as raised:
        TextTemplate(template).render(record)
    keys = sorted(record)
    assert str(raised.value) == f"text_template cannot render the record ({error}); the record has keys {keys}"


def test_a_template_pickles_for_worker_processes():
    template = TextTemplate("{title}: {text}", "--text-template")
    copy = pickle.loads(pickle.dumps(template))
    assert copy == template and copy.fields == ("title", "text")
    assert copy.render({"title": "a", "text": "b"}) == "a: b"


@pytest.mark.parametrize(
    "template",
    [
        "{text:>3000000000}",
        "{text:<1048577}",
        "{text:_^2000000}",
        "{number:03000000000d}",
        "{number:.3000000000f}",
        "{text:.2000000}",
        "### {title}\n{text:>99999999999999999999}",
    ],
)
def test_a_width_or_precision_past_the_limit_is_refused_when_the_template_is_checked(template):
    """A field that wide would be built in memory before anything could stop it (3 GB for the first)."""
    with pytest.raises(
        DataConfigError, match=r"text_template asks for a field [\d,]+ characters wide .*past the limit"
    ):
        TextTemplate(template)


def test_a_width_at_the_limit_renders():
    assert len(TextTemplate(f"{{text:>{FORMAT_WIDTH_LIMIT}}}").render({"text": "a"})) == FORMAT_WIDTH_LIMIT


@pytest.mark.parametrize("width", [FORMAT_WIDTH_LIMIT + 1, 3_000_000_000])
def test_a_width_taken_from_the_record_is_checked_before_the_text_is_built(width):
    template = TextTemplate("{text:>{width}}", "--text-template")
    assert template.render({"text": "ab", "width": 5}) == "   ab"
    with pytest.raises(DataFileError, match=r"^--text-template asks for a field [\d,]+ characters wide"):
        template.render({"text": "ab", "width": width})
    assert pickle.loads(pickle.dumps(template)).render({"text": "ab", "width": 3}) == " ab"


@pytest.mark.parametrize(
    "template",
    ["{text.__class__}", "{text.__class__.__mro__}", "{meta[title].__init__.__globals__}", "{body._private}"],
)
def test_a_private_attribute_is_refused(template):
    """Attribute paths through dunder names reach the program's internals (classes, globals), not the record."""
    with pytest.raises(DataConfigError, match=r"reads the private attribute .*read record fields and their items"):
        TextTemplate(template)
