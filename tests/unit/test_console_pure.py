"""The console's pure parts: horizon bins, the lateness ring, access decisions, settings, charts."""

from __future__ import annotations

import base64
import re

import pytest

from chronoq.core import acl
from chronoq.core import errors
from chronoq.console import access, charts, horizon
from chronoq.core import console_settings as settings
from chronoq.console.lateness import LatenessRing, interval
from chronoq.timer.stats import LatenessHistogram

MIN, HOUR = 60_000, 3_600_000
T0 = 1_800_000_000_000 - 1_800_000_000_000 % MIN  # a minute boundary


# ------------------------------------------------------------------------------ horizon
def _pending_by_horizon(now: int, buckets: dict[int, int], levels: list[int] = ()):
    """What ``TimerService.pending_by_horizon`` answers (its documented rule): a bucket counts
    at its start (overdue ones in every horizon), a delay-level message at its due time."""
    def answer(horizons):
        return [sum(n for s, n in buckets.items() if max(0, s - now) <= h) + sum(1 for d in levels if d <= now + h)
                for h in horizons]
    return answer


def _views(now: int, buckets: dict[int, int], levels: list[int] = (), width: int = MIN) -> dict:
    plan = horizon.view_plan(now, width)
    return horizon.bins(plan, _pending_by_horizon(now, buckets, levels)(plan["horizons_ms"]))


def test_bins_count_each_bucket_in_the_bin_of_its_start():
    for now in (T0, T0 + 1, T0 + 29_999, T0 + 30_000, T0 + 59_999):  # anywhere in the current bucket
        v = _views(now, {T0 - MIN: 5, T0: 2, T0 + 59 * MIN: 1, T0 + 60 * MIN: 4, T0 + 10_079 * MIN: 7,
                         T0 + 10_080 * MIN: 100})
        assert v["start_ms"] == T0
        assert v["minutes"]["pending"] == [5 + 2] + [0] * 58 + [1]  # the first bin holds the overdue
        assert v["minutes"]["starts_ms"][:2] == [T0, T0 + MIN] and len(v["minutes"]["starts_ms"]) == 60
        hours = v["hours"]["pending"]
        assert hours[0] == 8 and hours[1] == 4 and hours[167] == 7 and sum(hours) == 19 == v["total_week"]


def test_a_clock_a_few_ms_ahead_moves_no_bucket():
    plan = horizon.view_plan(T0 + 59_990, MIN)
    later = _pending_by_horizon(T0 + 59_990 + 5, {T0 + MIN: 3, T0 + 2 * MIN: 1})  # the timer's now: 5 ms on
    v = horizon.bins(plan, later(plan["horizons_ms"]))
    assert v["minutes"]["pending"][:3] == [0, 3, 1]


def test_delay_level_messages_count_at_their_due_time_rounded_to_a_bucket():
    v = _views(T0, {}, levels=[T0 + 10_000, T0 + 40_000, T0 + 5 * MIN + 1])
    assert v["minutes"]["pending"][:6] == [1, 1, 0, 0, 0, 1]


def test_wider_buckets_are_never_drawn_finer_than_the_data():
    width = 5 * MIN
    v = _views(T0 + 7 * MIN, {T0 + 10 * MIN: 3}, width=width)
    assert v["start_ms"] == T0 + 5 * MIN and v["minutes"]["step_ms"] == width
    assert v["minutes"]["pending"][:2] == [0, 3]


# ------------------------------------------------------------------------------ lateness
def _snapshot(values: list[int], early: int = 0) -> dict:
    h = LatenessHistogram()
    for v in values:
        h.record(v)
    h.early += early
    return h.snapshot()


def test_interval_percentiles_come_from_the_difference_of_snapshots():
    first = [3] * 99 + [400]
    second = first + [1] * 50 + [30] * 50
    s = interval(_snapshot(first), _snapshot(second), 0, 10_000)
    assert s.count == 100
    assert s.p50_ms == 1 and s.p99_ms == 50  # bucket upper bounds, as LatenessHistogram reports
    assert s.max_ms == 50  # the all-time max (400) did not grow: the highest bucket that gained
    grew = interval(_snapshot(first), _snapshot(first + [70_000]), 0, 1)
    assert grew.count == 1 and grew.max_ms == 70_000 and grew.p99_ms == 70_000
    empty = interval(_snapshot(first), _snapshot(first), 5, 6)
    assert empty.count == 0 and empty.p50_ms is None and empty.max_ms is None


def test_ring_keeps_the_newest_intervals_and_the_open_one_apart():
    ring = LatenessRing(capacity=3)
    values: list[int] = []
    for i in range(5):
        values += [i * 10]
        ring.observe(_snapshot(values), 1_000 * (i + 1))
    assert [(s.start_ms, s.end_ms, s.count) for s in ring.samples] == [(2000, 3000, 1), (3000, 4000, 1),
                                                                        (4000, 5000, 1)]
    assert [s.max_ms for s in ring.samples] == [20, 30, 40]
    open_now = ring.current(_snapshot(values + [1, 2], early=1), 5_500)
    assert (open_now.start_ms, open_now.end_ms, open_now.count, open_now.early) == (5000, 5500, 2, 1)
    assert len(ring.samples) == 3  # current() stores nothing
    with pytest.raises(AssertionError):  # a histogram never shrinks
        ring.observe(_snapshot([1]), 6_000)


# ------------------------------------------------------------------------------ access
USERS = acl.AccessControl([acl.User("ops", b"s3cret", admin=True), acl.User("viewer", b"look", subscribe=("*",))])


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_without_access_control_pages_are_open_and_writes_refused():
    assert access.decide(None, None, write=False).status == 200
    refused = access.decide(None, _basic("ops", "s3cret"), write=True)
    assert refused.status == 403 and "read-only" in refused.reason


@pytest.mark.parametrize("header,write,status", [
    (None, False, 401),
    ("Bearer abc", False, 401),
    ("Basic !!!", False, 401),
    (_basic("viewer", "nope"), False, 401),
    (_basic("nobody", "look"), False, 401),
    (_basic("viewer", "look"), False, 200),
    (_basic("viewer", "look"), True, 403),
    (_basic("ops", "s3cret"), True, 200),
    (_basic("ops", "s3cret:"), True, 401),
])
def test_with_access_control(header, write, status):
    d = access.decide(USERS, header, write=write)
    assert d.status == status
    assert (d.user is not None) == (status == 200 or status == 403)


def test_basic_credentials_keep_colons_in_the_password():
    assert access.basic_credentials(_basic("a", "b:c")) == ("a", "b:c")
    assert access.basic_credentials("Basic " + base64.b64encode(b"no-colon").decode()) is None
    assert access.basic_credentials("") is None


@pytest.mark.parametrize("origin,referer,ok", [
    (None, None, True),  # not a browser: forgery needs one
    ("http://127.0.0.1:8082", None, True),
    ("http://evil.example", None, False),
    (None, "http://127.0.0.1:8082/console/lookup?q=x", True),
    (None, "http://evil.example/page", False),
    ("null", None, False),  # a sandboxed or file page
])
def test_writes_must_come_from_the_consoles_own_pages(origin, referer, ok):
    assert access.same_origin("127.0.0.1:8082", origin, referer) is ok


# ------------------------------------------------------------------------------ settings and charts
def test_console_settings():
    assert settings.parse(None) == settings.ConsoleSettings()
    s = settings.parse({"lookup_scan_mib": 8, "lateness_interval_s": 0.5})
    assert s.lookup_scan_mib == 8 and s.lateness_interval_s == 0.5
    for bad in ({"nope": 1}, {"lookup_scan_mib": 0}, {"lookup_scan_mib": True}, {"lateness_samples": 1.5}, []):
        with pytest.raises(errors.ClientError):
            settings.parse(bad)


def test_console_settings_are_checked_when_the_config_is_loaded(tmp_path):
    from chronoq.core.config import load_config

    path = tmp_path / "chronoq.toml"
    path.write_text("[console]\ntrace_scan_mib = 128\n")
    assert load_config(str(path), env={}).extra["console"] == {"trace_scan_mib": 128}
    path.write_text("[console]\nlookup_scan_mb = 8\n")  # a typo: refused at load, not when HTTP starts
    with pytest.raises(errors.ClientError, match="lookup_scan_mb"):
        load_config(str(path), env={})


def test_chart_text_cannot_inject_markup():
    svg = charts.due_bars({"starts_ms": [T0], "step_ms": MIN, "pending": [3]}, "</svg><b>bold</b>")
    assert svg.startswith("<svg") and "<b>" not in svg and "&lt;b&gt;" in svg


def _bar_heights(svg: str) -> list[float]:
    return [float(h) for h in re.findall(r'<rect [^>]*height="([0-9.]+)" class="rect reactive tooltip-trigger"', svg)]


def test_the_week_chart_turns_to_a_log_scale_when_one_bin_dwarfs_the_rest():
    even = [0] * 168
    even[5], even[50] = 40, 10
    assert "log scale" not in charts.due_bars({"starts_ms": [T0 + i * HOUR for i in range(168)], "step_ms": HOUR,
                                               "pending": even}, "week")
    dwarfed = list(even)
    dwarfed[3] = 100_000
    svg = charts.due_bars({"starts_ms": [T0 + i * HOUR for i in range(168)], "step_ms": HOUR, "pending": dwarfed},
                          "week")
    assert "log scale" in svg
    heights = sorted(_bar_heights(svg))
    assert len(heights) == 3
    assert heights[0] > heights[-1] / 5  # the 10 is still a bar you see beside the 100,000 (linear: 1/10,000)


def test_the_lateness_chart_spans_the_data_it_has():
    from chronoq.console.lateness import Sample

    samples = [Sample(T0 + i * 10_000, T0 + (i + 1) * 10_000, 1 if i in (40, 45) else 0, 2, 5, 9, 0) for i in range(60)]
    svg = charts.lateness_lines(samples)
    labels = re.findall(r">(\d\d:\d\d:\d\d)<", svg)
    # Intervals with deliveries end at T0 + 410 s and T0 + 460 s: the axis covers those, not the hour.
    first, last = T0 + 410_000, T0 + 460_000
    assert labels and min(labels) >= charts.iso(first - 10_000)[11:] and max(labels) <= charts.iso(last + 10_000)[11:]
