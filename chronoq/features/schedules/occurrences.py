"""When a schedule fires: occurrence instants in an IANA time zone, DST rules, the catch-up policy.

Pure: no I/O, no clock (every function takes the instants it needs, epoch ms), no state. The cron
expressions are parsed by ``croniter`` (a well-kept parser; chronoq writes none); this module only
maps its local wall-clock times to instants with ``zoneinfo``.

Rules (docs/timers.md, "Recurring schedules"):

* **Cron** expressions (5 fields, or 6 with seconds last, croniter's syntax) match *local wall-clock
  times* in the schedule's zone. Each matching local time fires once, at the instant it names:
  - a local time that **does not exist** (the hour skipped when clocks go forward) fires at the
    **next valid instant**: the transition itself (Europe/Berlin 02:30 on the last Sunday of March
    fires at 03:00 CEST);
  - a local time that **occurs twice** (the hour repeated when clocks go back) fires **once**, at
    its first occurrence (daylight time, ``fold=0``);
  - occurrences are identified by their instant, so several local times that map to one instant
    (02:00, 02:15, ... inside a skipped hour, and 03:00) fire once.
  Consequence: a cron schedule does not fire during the second pass of a repeated hour. A schedule
  that must fire at a steady rate in real time uses an interval (or the zone ``UTC``).
* **Intervals** fire at ``anchor + k * interval`` (k = 0, 1, ...), absolute instants: no DST. The
  anchor is the schedule's start, or its creation time when it has none (first firing one interval
  after creation).
* ``start_ms``/``end_ms`` bound the occurrences (both inclusive).
* **Catch-up** (``plan``): an occurrence whose instant has passed before it was handed to the timer
  (the broker was down, or could not write) is *missed*. ``skip``: missed ones never fire.
  ``once`` (the default): the latest missed one fires, once, at once; the others never.
  ``all``: the latest ``catch_up_max`` missed ones fire at once, the older never.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from chronoq.core import errors
from chronoq.timer.deliverytime import YEAR_2000_MS

CATCH_UP_POLICIES = ("skip", "once", "all")
CATCH_UP_DEFAULT = "once"
INTERVAL_MS_MIN = 1_000          # an interval schedule fires at most once a second
INTERVAL_MS_MAX = 366 * 86_400_000
MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: the last instant a date (and a cron) can name
# Local times a cron lookup may step over without an occurrence past the cursor (the second pass
# of a repeated hour of a once-a-second expression is 3,600): a bound, not a tuning knob.
_STEPS_MAX = 10_000

_UTC = timezone.utc


@dataclass(frozen=True, slots=True)
class Spec:
    """When a schedule fires. Exactly one of ``cron``/``interval_ms``; ``anchor_ms`` is where an
    interval counts from (the start, or the creation time)."""

    cron: str
    interval_ms: int
    tz: str
    start_ms: int
    end_ms: int       # 0: no end
    anchor_ms: int

    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)


# Names ZoneInfo opens that are not zones: the host's zone (it would change with the machine), the
# file of default rules, and a placeholder.
_NOT_ZONES = frozenset(("localtime", "posixrules", "Factory"))


def make_spec(cron: str, interval_ms: int, tz: str, start_ms: int, end_ms: int, now_ms: int) -> Spec:
    """A checked ``Spec`` (``errors.ClientError`` naming what is wrong)."""
    cron = (cron or "").strip()
    if bool(cron) == bool(interval_ms):
        raise errors.ClientError("give either a cron expression or an interval, not both or neither")
    tz = tz or "UTC"
    try:
        if tz in _NOT_ZONES or tz.startswith(("posix/", "right/")):
            raise ValueError(tz)  # files beside the zones: the host's own zone, and variants
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # (OSError: a name too long for a file name)
        raise errors.ClientError(f"unknown time zone {tz[:64]!r}: use an IANA name such as Europe/Berlin") from None
    for what, ms in (("start", start_ms), ("end", end_ms)):
        if ms > MAX_MS:
            raise errors.ClientError(f"the {what} {ms} is after the year 9999 (epoch milliseconds)")
        if ms < 0 or 0 < ms < YEAR_2000_MS:
            hint = f" ({ms} looks like epoch seconds: {ms * 1000} ms)" if YEAR_2000_MS <= ms * 1000 else ""
            raise errors.ClientError(f"the {what} is epoch milliseconds (0: none), not {ms}{hint}")
    if end_ms and end_ms < start_ms:
        raise errors.ClientError("the end is before the start")
    if end_ms and end_ms <= now_ms:
        raise errors.ClientError("the end is already past: the schedule would never fire")
    if cron:
        # 5 fields, or 6 with seconds last: what the docs promise (croniter takes more: a year
        # field, "@daily" and the like).
        if len(cron) > 256 or len(cron.split()) not in (5, 6) or not croniter.is_valid(cron):
            raise errors.ClientError(f"not a valid cron expression: {cron[:80]!r} (5 fields, or 6 with seconds last)")
    elif not isinstance(interval_ms, int) or not INTERVAL_MS_MIN <= interval_ms <= INTERVAL_MS_MAX:
        raise errors.ClientError(f"the interval must be between {INTERVAL_MS_MIN} and {INTERVAL_MS_MAX} ms")
    spec = Spec(cron, interval_ms if not cron else 0, tz, start_ms, end_ms, start_ms or now_ms)
    first = next_after(spec, max(now_ms, start_ms - 1))
    if first is None or (end_ms and first > end_ms):
        raise errors.ClientError("the schedule never fires" + (" before its end" if end_ms else "")
                                 + (f" (cron expression {cron!r})" if cron else ""))
    return spec


def _local(instant_ms: int, zone: ZoneInfo) -> datetime:
    """The naive local wall-clock time of an instant (ms kept as microseconds)."""
    return datetime.fromtimestamp(instant_ms // 1000, zone).replace(microsecond=(instant_ms % 1000) * 1000,
                                                                   tzinfo=None)


def _latest_local(instant_ms: int, zone: ZoneInfo) -> datetime:
    """The latest local wall-clock time any instant up to ``instant_ms`` had: its own, but in the
    second pass of a repeated hour the first pass went further (Berlin 02:10 CET comes after
    02:59:59 CEST): the time read with the first pass's offset."""
    seen = datetime.fromtimestamp(instant_ms // 1000, zone)
    local = seen.replace(microsecond=(instant_ms % 1000) * 1000, tzinfo=None)
    if seen.fold:
        local += seen.replace(fold=0).utcoffset() - seen.utcoffset()
    return local


def to_instant_ms(local: datetime, zone: ZoneInfo) -> int:
    """The instant a local wall-clock time (whole seconds) fires at: itself; the first pass when it
    occurs twice (``fold=0``); the transition when it does not exist (the next valid instant)."""
    after_offset = int(local.replace(tzinfo=zone, fold=0).timestamp())
    if datetime.fromtimestamp(after_offset, zone).replace(tzinfo=None) == local:
        return after_offset * 1000
    # In a gap: fold=0 read it with the offset before the transition (an instant after it), fold=1
    # with the offset after (an instant before it). The transition is the first second whose
    # offset differs from the earlier one: a binary search over at most a few hours of seconds.
    lo = int(local.replace(tzinfo=zone, fold=1).timestamp())
    hi = after_offset
    assert lo < hi, (local, zone)
    before = datetime.fromtimestamp(lo, zone).utcoffset()
    while hi - lo > 1:  # invariant: offset(lo) == before != offset(hi)
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == before:
            lo = mid
        else:
            hi = mid
    return hi * 1000


def next_after(spec: Spec, after_ms: int) -> int | None:
    """The first occurrence instant > ``after_ms`` (and >= the start, <= the end), or None."""
    after_ms = max(after_ms, spec.start_ms - 1)
    if spec.interval_ms:
        k = max(0, (after_ms - spec.anchor_ms) // spec.interval_ms + 1)
        at = spec.anchor_ms + k * spec.interval_ms
        assert at > after_ms
    else:
        zone = spec.zone()
        try:
            it = croniter(spec.cron, _local(after_ms, zone))
            for _ in range(_STEPS_MAX):
                at = to_instant_ms(it.get_next(datetime), zone)
                if at > after_ms:  # (not: the second pass of a repeated hour maps to its first)
                    break
            else:
                return None
        except (CroniterBadDateError, OverflowError, ValueError):
            return None
    if spec.end_ms and at > spec.end_ms:
        return None
    return at


def latest_at_or_before(spec: Spec, at_ms: int, after_ms: int, count: int) -> list[int]:
    """Up to ``count`` occurrence instants in (``after_ms``, ``at_ms``], the latest ones, ascending."""
    lo = max(after_ms, spec.start_ms - 1)
    hi = min(at_ms, spec.end_ms) if spec.end_ms else at_ms
    if hi <= lo or count <= 0:
        return []
    out: list[int] = []
    if spec.interval_ms:
        k = (hi - spec.anchor_ms) // spec.interval_ms
        while k >= 0 and len(out) < count:
            at = spec.anchor_ms + k * spec.interval_ms
            if at <= lo:
                break
            out.append(at)
            k -= 1
        return out[::-1]
    zone = spec.zone()
    try:
        # Backwards from the latest local time reached by hi: from hi's own local time, the first
        # pass of a repeated hour (later on the wall clock, earlier in time) would be stepped over.
        it = croniter(spec.cron, _latest_local(hi + 1, zone))
        for _ in range(_STEPS_MAX + count):
            at = to_instant_ms(it.get_prev(datetime), zone)
            if at > hi or (out and at >= out[-1]):
                continue  # a later-mapped gap time, or an instant already taken
            if at <= lo:
                break
            out.append(at)
            if len(out) >= count:
                break
    except (CroniterBadDateError, OverflowError, ValueError):
        pass
    return out[::-1]


def upcoming(spec: Spec, after_ms: int, count: int) -> list[int]:
    """The next ``count`` occurrence instants after ``after_ms`` (for display)."""
    out: list[int] = []
    at: int | None = after_ms
    while len(out) < count:
        at = next_after(spec, at)
        if at is None:
            break
        out.append(at)
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    """What a round hands the timer for one schedule: ``fire`` (ascending instants; those <= now
    fire at once), and the new cursor (every occurrence <= it is resolved: handed over or skipped)."""

    fire: tuple[int, ...]
    missed_skipped: bool
    cursor_ms: int


def plan(spec: Spec, policy: str, cursor_ms: int, now_ms: int, horizon_ms: int, room: int,
         catch_up_max: int) -> Plan:
    """Occurrences to hand over now: the missed ones in (cursor, now] per ``policy`` (at most
    ``catch_up_max``; they fire at once), then those in (now, now + horizon], at most ``room`` (the
    pending hand-overs a schedule may hold). Ensures: every occurrence <= the returned cursor is in
    ``fire`` or skipped by the policy; the cursor never moves back; instants are unique, ascending."""
    assert policy in CATCH_UP_POLICIES and room >= 0 and catch_up_max >= 1
    fire: list[int] = []
    skipped = False
    cursor = max(cursor_ms, spec.start_ms - 1)
    first = next_after(spec, cursor)
    if first is not None and first <= now_ms:  # missed: their instant passed before the hand-over
        keep = {"skip": 0, "once": 1, "all": catch_up_max}[policy]
        fire = latest_at_or_before(spec, now_ms, cursor, keep)
        skipped = not fire or fire[0] != first
        cursor = now_ms
    ahead: list[int] = []
    at = cursor
    limit = now_ms + horizon_ms
    while len(ahead) < room:
        nxt = next_after(spec, at)
        if nxt is None or nxt > limit:
            at = limit if nxt is not None else max(at, now_ms)
            break
        ahead.append(nxt)
        at = nxt
    cursor = max(cursor, at, cursor_ms)
    fire += ahead
    assert all(a < b for a, b in zip(fire, fire[1:])) and all(cursor_ms < a <= cursor for a in fire)
    return Plan(tuple(fire), skipped, cursor)
