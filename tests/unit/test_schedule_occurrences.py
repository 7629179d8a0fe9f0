"""The DST rules of recurring schedules, instant by instant (chronoq.features.schedules.occurrences):
a local time that does not exist fires at the next valid instant; one that occurs twice fires once;
the catch-up policies; start and end bounds."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from chronoq.core import errors
from chronoq.features.schedules import occurrences as occ


def _ms(*a, tz="UTC") -> int:
    return int(datetime(*a, tzinfo=ZoneInfo(tz)).timestamp() * 1000)


def _local(ms: int, tz: str) -> str:
    return datetime.fromtimestamp(ms / 1000, ZoneInfo(tz)).isoformat()


def _next(cron, tz, after, n):
    return [_local(t, tz) for t in occ.upcoming(occ.make_spec(cron, 0, tz, 0, 0, after), after, n)]


def test_berlin_skipped_hour_fires_at_the_transition_once():
    after = _ms(2026, 3, 28, 12)
    assert _next("30 2 * * *", "Europe/Berlin", after, 2) == ["2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"]
    # 02:00 and 02:30 do not exist: both land on 03:00, which fires once.
    assert _next("0,30 2,3 * * *", "Europe/Berlin", after, 3) == [
        "2026-03-29T03:00:00+02:00", "2026-03-29T03:30:00+02:00", "2026-03-30T02:00:00+02:00"]


def test_new_york_repeated_hour_fires_once_at_its_first_pass():
    after = _ms(2026, 10, 31, 12)
    assert _next("*/30 0-2 * * *", "America/New_York", after, 6) == [
        "2026-11-01T00:00:00-04:00", "2026-11-01T00:30:00-04:00", "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00", "2026-11-01T02:00:00-05:00", "2026-11-01T02:30:00-05:00"]
    # From inside the second pass, the first pass's times are not fired again.
    second_pass = _ms(2026, 11, 1, 6, 10)  # 01:10 EST
    assert _next("*/30 0-2 * * *", "America/New_York", second_pass, 1) == ["2026-11-01T02:00:00-05:00"]


def test_new_york_spring_forward():
    assert _next("30 2 * * *", "America/New_York", _ms(2026, 3, 7, 12), 1) == ["2026-03-08T03:00:00-04:00"]


def test_lord_howe_half_hour_shifts():
    forward = _next("*/15 2 * * *", "Australia/Lord_Howe", _ms(2026, 10, 3, 14), 3)
    assert forward == ["2026-10-04T02:30:00+11:00", "2026-10-04T02:45:00+11:00", "2026-10-05T02:00:00+11:00"]
    back = _next("*/15 1 * * *", "Australia/Lord_Howe", _ms(2026, 4, 4, 13), 5)
    assert back == ["2026-04-05T01:00:00+11:00", "2026-04-05T01:15:00+11:00", "2026-04-05T01:30:00+11:00",
                    "2026-04-05T01:45:00+11:00", "2026-04-06T01:00:00+10:30"]


def test_catch_up_policies():
    t0 = _ms(2026, 1, 1)
    spec = occ.make_spec("", 1000, "UTC", 0, 0, t0)
    now = t0 + 5_500  # occurrences at +1 .. +5 s missed
    skip = occ.plan(spec, "skip", t0, now, 2000, 100, 1000)
    once = occ.plan(spec, "once", t0, now, 2000, 100, 1000)
    every = occ.plan(spec, "all", t0, now, 2000, 100, 3)
    assert skip.fire == (t0 + 6000, t0 + 7000)
    assert once.fire == (t0 + 5000, t0 + 6000, t0 + 7000)
    assert every.fire == (t0 + 3000, t0 + 4000, t0 + 5000, t0 + 6000, t0 + 7000)  # bounded: the latest 3
    assert skip.cursor_ms == once.cursor_ms == every.cursor_ms == now + 2000


def test_start_end_and_room():
    t0 = _ms(2026, 1, 1)
    spec = occ.make_spec("", 1000, "UTC", t0 + 10_000, t0 + 12_000, t0)
    assert occ.upcoming(spec, t0, 10) == [t0 + 10_000, t0 + 11_000, t0 + 12_000]
    p = occ.plan(occ.make_spec("", 1000, "UTC", 0, 0, t0), "once", t0, t0, 60_000, 2, 10)
    assert p.fire == (t0 + 1000, t0 + 2000) and p.cursor_ms == t0 + 2000  # the rest next round


@pytest.mark.parametrize("kw", [dict(cron="* * * * *", interval_ms=1000), dict(), dict(cron="nope"),
                                dict(cron="* * * * *", tz="Mars/Olympus"), dict(interval_ms=10),
                                dict(cron="0 0 31 2 *"),
                                # what the docs do not promise: a year field, croniter's nicknames
                                dict(cron="0 0 * * * * 2030"), dict(cron="@daily"),
                                # the host's own zone, not a zone
                                dict(cron="* * * * *", tz="localtime"), dict(cron="* * * * *", tz="posix/UTC"),
                                # a name too long for a file name (OSError: was an INTERNAL error and a traceback)
                                dict(cron="* * * * *", tz="Europe/" + "x" * 300),
                                # epoch seconds for milliseconds; an end already past; no firing before the end
                                dict(interval_ms=60_000, start_ms=_ms(2026, 1, 2) // 1000),
                                dict(interval_ms=60_000, end_ms=_ms(2025, 12, 31)),
                                dict(interval_ms=3_600_000, end_ms=_ms(2026, 1, 1) + 60_000),
                                dict(cron="0 9 * * *", end_ms=_ms(2026, 1, 1) + 60_000)])
def test_bad_specs_are_refused(kw):
    args = dict(cron="", interval_ms=0, tz="UTC", start_ms=0, end_ms=0, now_ms=_ms(2026, 1, 1))
    args.update(kw)
    with pytest.raises(errors.ClientError):
        occ.make_spec(**args)


def test_catch_up_all_is_bounded_by_its_own_limit_not_by_the_hand_over_room():
    t0 = _ms(2026, 1, 1)
    spec = occ.make_spec("", 1000, "UTC", 0, 0, t0)
    p = occ.plan(spec, "all", t0, t0 + 50_500, 3000, 2, 10)  # 50 missed; 2 pending hand-overs allowed
    assert p.fire == tuple(t0 + 41_000 + 1000 * i for i in range(10)) + (t0 + 51_000, t0 + 52_000)
    assert p.cursor_ms == t0 + 52_000 and p.missed_skipped


# Around each zone's transitions: (zone, one instant just before its fall-back, one before its spring-forward).
_TRANSITIONS = {"Europe/Berlin": (_ms(2027, 10, 31, 0, 30), _ms(2027, 3, 28, 0, 30)),
                "America/New_York": (_ms(2027, 11, 7, 5, 30), _ms(2027, 3, 14, 6, 30)),
                "Australia/Lord_Howe": (_ms(2027, 4, 3, 14, 30), _ms(2027, 10, 2, 15))}


@pytest.mark.parametrize("tz", sorted(_TRANSITIONS))
@pytest.mark.parametrize("cron", ["*/15 * * * *", "30 2 * * *", "45 1 * * *", "0 * * * *", "5 1,2,3 * * *"])
def test_latest_missed_occurrences_are_those_next_after_walks_to(tz, cron):
    """Catch-up's backwards lookup (``latest_at_or_before``) against the forward walk of
    ``next_after``, for windows ending anywhere around a transition: a broker back in the second
    pass of a repeated hour lost the first pass's occurrences (later on the wall clock)."""
    spec = occ.make_spec(cron, 0, tz, 0, 0, _ms(2027, 1, 1))
    for base in _TRANSITIONS[tz]:
        for lo_min in range(-120, 180, 25):
            lo = base + lo_min * 60_000
            for span_min in (1, 20, 50, 95, 190, 1500):
                hi = lo + span_min * 60_000 + 7_000
                walked, at = [], lo
                while (at := occ.next_after(spec, at)) is not None and at <= hi:
                    walked.append(at)
                for count in (1, 3, 1000):
                    assert occ.latest_at_or_before(spec, hi, lo, count) == walked[-count:], (lo, hi, count)


def test_back_in_the_second_pass_once_fires_the_latest_missed_occurrence():
    """Down from 01:50 CEST to 02:10 CET (Berlin, the hour repeated): 02:30 CEST was missed."""
    spec = occ.make_spec("30 2 * * *", 0, "Europe/Berlin", 0, 0, _ms(2027, 10, 30))
    cursor, now = _ms(2027, 10, 30, 23, 50), _ms(2027, 10, 31, 1, 10)  # (UTC)
    plan = occ.plan(spec, "once", cursor, now, 60_000, 10, 1000)
    assert [_local(t, "Europe/Berlin") for t in plan.fire] == ["2027-10-31T02:30:00+02:00"]
    assert not plan.missed_skipped
