"""chronoq.core.validate: the rules per field (docs/security.md, "Validation").

The forged message group on each embedded entry point: test_forged_fields.py; the gRPC entry
point and the round trip of everything accepted: tests/integration/test_validate_entry_points.py.
"""

from __future__ import annotations

import pytest

from chronoq.core import errors, validate
from chronoq.store import record

FORGED_GROUP = "g\x02evil\x01yes"  # would read back as group "g" plus a user property evil=yes


# ------------------------------------------------------------------------------ the rules
@pytest.mark.parametrize("text", ["\x00", "\x01", "\x02", "\x1f", "\x7f", "a\ud800", "\udfff"])
def test_control_characters_and_lone_surrogates_are_found(text):
    assert validate.has_control(text)


@pytest.mark.parametrize("text", ["abc", "é中\U0001f600", "a\u00a0b", "\u2028", "", "a b"])
def test_other_text_has_no_control(text):
    assert not validate.has_control(text)


@pytest.mark.parametrize("group", [FORGED_GROUP, "a\x01", "\x02", "a\ud800", " ", "", "g" * 64, "é" * 32, 5])
def test_bad_message_groups(group):
    with pytest.raises(errors.InvalidMessageGroup):
        validate.message_group(group)


@pytest.mark.parametrize("group", ["g", "order-1", "é" * 31, "g" * 63, "a b", "中文"])
def test_good_message_groups(group):
    assert validate.message_group(group) == group


@pytest.mark.parametrize("props", [{"k": "a\x02b"}, {"k": "a\x01b"}, {"k\x01": "v"}, {"k\x00": "v"},
                                   {"k": "\ud800"}, {"\udc00": "v"}, {"": "v"}, {"__GROUP": "g"}, {"k": 1}])
def test_bad_properties(props):
    with pytest.raises(errors.InvalidProperty):
        validate.properties(props)


def test_property_values_keep_other_control_characters():
    # Only the separators are ambiguous in a value; RocketMQ clients allow the rest.
    assert validate.properties({"k": "tab\there\x00nul"}) == {"k": "tab\there\x00nul"}


@pytest.mark.parametrize("tag", ["a|b", "a\x01", "\ud800", " ", "x" * 1025, "é" * 513, 3])
def test_bad_tags(tag):
    with pytest.raises(errors.InvalidTag):
        validate.tag(tag)


@pytest.mark.parametrize("keys", [["a\x01b"], [" "], [""], ["\ud800"], ["k" * 16_384], 7])
def test_bad_keys(keys):
    with pytest.raises(errors.InvalidKey):
        validate.keys(keys)


@pytest.mark.parametrize("mid", ["", " ", "a\x01", "é", "\ud800", "x" * 129, 1])
def test_bad_message_ids(mid):
    with pytest.raises(errors.InvalidMessageId):
        validate.message_id(mid)


def test_bulk_id_check_never_passes_what_message_id_refuses():
    for mid in ["", " ", "a b", "a\x01", "é", "x" * 129]:
        assert not validate.plain_message_ids(["ok", mid])
    assert validate.plain_message_ids(["a", "B-1", "x" * 128])


def test_bodies():
    assert validate.body("é", 10) == "é".encode()
    assert validate.body(bytearray(b"ab"), 10) == b"ab"
    with pytest.raises(errors.BodyEmpty):
        validate.body(b"", 10)
    with pytest.raises(errors.BodyTooLarge):
        validate.body(b"x" * 11, 10)
    with pytest.raises(errors.ClientError, match="surrogate"):
        validate.body("\ud800", 10)


def test_the_encoders_refuse_a_separator_that_slipped_through():
    with pytest.raises(AssertionError):
        record.encode_properties({"g": "a\x02b\x01c"})
    with pytest.raises(AssertionError):
        record.encode_keys(("a\x01b",))


def test_keys_may_hold_spaces_and_are_kept_whole():
    """As the RocketMQ proxy: only blank keys and control characters are refused."""
    assert validate.keys(["order 42", "k"]) == ("order 42", "k")
