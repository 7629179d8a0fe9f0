"""Level tables, delivery-time validation (incl. the seconds/milliseconds quirk), recall handles."""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.core.config import BrokerConfig, load_config
from chronoq.timer import deliverytime, handle
from chronoq.core.delay_levels import DEFAULT_LEVELS, DelayLevels, format_duration, parse_duration

NOW = 1_700_000_000_000
TWO_YEARS = 730 * 86_400_000


def test_default_table_is_rocketmqs():
    levels = DelayLevels.parse(DEFAULT_LEVELS)
    assert len(levels) == 18
    assert levels.delay_ms(1) == 1_000 and levels.delay_ms(4) == 30_000
    assert levels.delay_ms(5) == 60_000 and levels.delay_ms(18) == 7_200_000
    assert [d["delay"] for d in levels.describe()][:3] == ["1s", "5s", "10s"]
    assert DelayLevels.queue_id(1) == 0 and DelayLevels.level_of_queue(17) == 18


@pytest.mark.parametrize("text,ms", [("250ms", 250), ("1s", 1000), ("2m", 120_000), ("1h", 3_600_000),
                                     ("1d", 86_400_000), (" 30S ", 30_000)])
def test_units(text, ms):
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text,fragment", [
    ("5x", "unknown unit 'x'"), ("1.5s", "whole number"), ("s", "whole number"), ("0s", "longer than zero"),
    ("-1s", "whole number"), ("", "whole number")])
def test_bad_durations_say_what_is_wrong(text, fragment):
    with pytest.raises(errors.ClientError, match=fragment):
        parse_duration(text)


def test_bad_tables_name_the_level():
    with pytest.raises(errors.ClientError, match="level 3"):
        DelayLevels.parse("1s 5s 7q")
    with pytest.raises(errors.ClientError, match="empty"):
        DelayLevels.parse("   ")
    with pytest.raises(errors.ClientError, match="at most 64"):
        DelayLevels.parse(" ".join(["1s"] * 65))
    with pytest.raises(errors.ClientError, match="longer than 30 days"):
        DelayLevels.parse("1s 31d")


def test_level_out_of_range_is_an_invalid_delivery_time():
    levels = DelayLevels.parse("1s 5s")
    for bad in (0, 3, -1, "1", True, None):
        with pytest.raises(errors.InvalidDeliveryTime, match="levels are 1..2"):
            levels.check(bad)


def test_format_duration():
    assert format_duration(60_000) == "1m" and format_duration(1_500) == "1500ms"
    assert format_duration(86_400_000) == "1d"


def test_config_validates_timer_settings():
    BrokerConfig().validate()
    with pytest.raises(errors.ClientError, match="level 2"):
        BrokerConfig(timer_delay_levels="1s zz").validate()
    with pytest.raises(errors.ClientError, match="power of two"):
        BrokerConfig(timer_wheel_slots=1000).validate()
    with pytest.raises(errors.ClientError, match="timer_deliver_mode"):
        BrokerConfig(timer_deliver_mode="later").validate()
    with pytest.raises(errors.ClientError, match="timer_bucket_ms"):
        BrokerConfig(timer_bucket_ms=0).validate()
    cfg = load_config(env={"CHRONOQ_TIMER_DELAY_LEVELS": "1s 2s", "CHRONOQ_TIMER_BUCKET_MS": "1_000"})
    assert cfg.timer_delay_levels == "1s 2s" and cfg.timer_bucket_ms == 1000


# ----------------------------------------------------------------- delivery times
def test_deliver_at_limits():
    assert deliverytime.check_deliver_at(NOW + 5, NOW, TWO_YEARS) == NOW + 5
    assert deliverytime.check_deliver_at(NOW - 5, NOW, TWO_YEARS) == NOW - 5  # past: at once
    assert deliverytime.check_deliver_at(NOW + TWO_YEARS, NOW, TWO_YEARS) == NOW + TWO_YEARS
    with pytest.raises(errors.InvalidDeliveryTime, match="is about 2.0 years ahead; the maximum delay is about 2.0 years .*timer_max_delay_ms"):
        deliverytime.check_deliver_at(NOW + TWO_YEARS + 1, NOW, TWO_YEARS)
    for bad in (1.5, "1", None, True):
        with pytest.raises(errors.InvalidDeliveryTime, match="integer"):
            deliverytime.check_deliver_at(bad, NOW, TWO_YEARS)


def test_delivery_times_that_cannot_be_epoch_milliseconds_are_refused_with_a_hint():
    # Epoch seconds given as milliseconds (January 1970) or a delay given as a time would deliver
    # at once without a word; they are refused, saying what the value looks like.
    seconds = NOW // 1000 + 60
    with pytest.raises(errors.InvalidDeliveryTime, match=f"looks like epoch seconds \\({seconds * 1000} in milliseconds"):
        deliverytime.check_deliver_at(seconds, NOW, TWO_YEARS)
    with pytest.raises(errors.InvalidDeliveryTime, match=f"for a delay, give now \\+ the delay \\({NOW + 60_000} for"):
        deliverytime.check_deliver_at(60_000, NOW, TWO_YEARS)
    for bad in (-1, -5000, -62_135_596_800_000):
        with pytest.raises(errors.InvalidDeliveryTime, match="before 1970"):
            deliverytime.check_deliver_at(bad, NOW, TWO_YEARS)
    assert deliverytime.check_deliver_at(0, NOW, TWO_YEARS) == 0  # no time: at once
    three_years_ago = NOW - 3 * 365 * 86_400_000  # a real time from years ago (old data replayed)
    assert deliverytime.check_deliver_at(three_years_ago, NOW, TWO_YEARS) == three_years_ago
    # A clock near the epoch (tests' fake clocks): the floor follows it, nothing positive is refused.
    assert deliverytime.check_deliver_at(5, 10_000, TWO_YEARS) == 5


def test_client_timestamp_in_seconds_is_accepted():
    seconds = NOW // 1000 + 60
    assert deliverytime.from_client_timestamp(seconds, 500_000_000, NOW, TWO_YEARS) == seconds * 1000 + 500


def test_milliseconds_passed_as_seconds_are_explained():
    ms = NOW + 60_000  # what a user passes when they think in milliseconds
    with pytest.raises(errors.InvalidDeliveryTime) as info:
        deliverytime.from_client_timestamp(ms, 0, NOW, TWO_YEARS)
    text = str(info.value)
    assert "milliseconds" in text and "seconds" in text and f"Pass {ms // 1000}" in text
    assert "year ~55," in text
    # A far date that is not a misread unit gets the ordinary limit message.
    with pytest.raises(errors.InvalidDeliveryTime, match="maximum delay"):
        deliverytime.from_client_timestamp(NOW // 1000 + 3 * 365 * 86_400, 0, NOW, TWO_YEARS)
    with pytest.raises(errors.InvalidDeliveryTime, match="not a valid timestamp"):
        deliverytime.from_client_timestamp(1, -1, NOW, TWO_YEARS)


# ----------------------------------------------------------------- recall handles
def test_handle_roundtrip_and_is_printable():
    h = handle.RecallHandle(handle.TIMER, 0, 123_456_789, NOW + 5, "orders", "0102ABCDEF")
    text = h.encode()
    assert text.startswith("1") and text.isprintable() and " " not in text
    assert handle.decode(text) == h
    lv = handle.RecallHandle(handle.LEVEL, 3, 42, NOW, "orders", "id-1")
    assert handle.decode(lv.encode()) == lv


@pytest.mark.parametrize("text,fragment", [
    ("", "missing"), (None, "missing"), ("3AAAA", "version"), ("1@@@", "base64"), ("1AAAA", "truncated"),
    ("1" + "A" * 2000, "not a chronoq recall handle")])
def test_bad_handles_are_client_errors(text, fragment):
    with pytest.raises(errors.ClientError, match=fragment):
        handle.decode(text)


def test_a_mangled_handle_fails_its_checksum():
    text = handle.RecallHandle(handle.TIMER, 0, 7, NOW, "t", "m").encode()
    mangled = text[:-3] + ("B" if text[-3] != "B" else "C") + text[-2:]
    with pytest.raises(errors.ClientError):
        handle.decode(mangled)
