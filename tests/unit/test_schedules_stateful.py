"""Property: recurring schedules fire every occurrence exactly once (per the catch-up policy),
never early, never twice, across pause/resume/delete, DST transitions in three zones and crashes.

A Hypothesis ``RuleBasedStateMachine`` drives the embedded broker and its ``ScheduleBook`` on a
fake clock that starts shortly before a DST transition (Europe/Berlin, America/New_York,
Australia/Lord_Howe: 30 minutes; both directions). Time moves like the server's loop moves it:
from one deadline (a round, a timer tick) to the next, each run when due. Crashes drop the broker
as ``kill -9`` does (``timerkit.crash``), at a chosen point of a round: between rounds, after the
intent is saved, after the occurrences are written (page cache), after their fsync; with
``lose_unsynced`` the unsynced tail of the commit log is cut first (a power loss). The broker may
stay down a while (the catch-up policy then decides). After every step, checked against a model
built from the schedule's own occurrence list:

* no occurrence is visible before its instant, none twice;
* every occurrence in a running, unpaused stretch is visible once its time has come;
* occurrences while paused or deleted never fire (except within the prewrite window of a pause);
* after downtime: ``skip`` fires none of the missed, ``once`` the latest, ``all`` every one;
  occurrences the timer already held before the crash (within the round horizon) may fire, once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from datetime import datetime, timezone

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chronoq.core.clock import FakeClock
from chronoq.features.schedules import occurrences as occ
from chronoq.features.schedules.book import PROP_SCHEDULE, PROP_SCHEDULE_AT, ScheduleBook
from tests.unit.timerkit import crash, open_broker, visible

TOPIC = "sched"
HORIZON_MS = 60_000
PREWRITE_MS = 50


def _utc(*a) -> int:
    return int(datetime(*a, tzinfo=timezone.utc).timestamp() * 1000)


# Half an hour before a DST transition (UTC instants of the transitions in 2026).
STARTS = [_utc(2026, 3, 29, 0, 30),   # Europe/Berlin forward (01:00 UTC)
          _utc(2026, 10, 25, 0, 30),  # Europe/Berlin back
          _utc(2026, 3, 8, 6, 30),    # America/New_York forward (07:00 UTC)
          _utc(2026, 11, 1, 5, 30),   # America/New_York back (06:00 UTC)
          _utc(2026, 10, 3, 15, 0),   # Australia/Lord_Howe forward 30 min (15:30 UTC)
          _utc(2026, 4, 4, 14, 30)]   # Australia/Lord_Howe back 30 min (15:00 UTC)
SPECS = [("Europe/Berlin", "*/15 * * * *", 0), ("America/New_York", "*/10 0-3 * * *", 0),
         ("Australia/Lord_Howe", "0,15,30,45 1-3 * * *", 0), ("Europe/Berlin", "30 2 * * *", 0),
         ("UTC", "", 7 * 60_000), ("America/New_York", "5,35 1 * * *", 0)]
NAMES = [f"s{i}" for i in range(4)]
POLICIES = st.sampled_from(occ.CATCH_UP_POLICIES)
STEP_MS = st.sampled_from([1, 999, 60_000, 7 * 60_000, 30 * 60_000, 2 * 3_600_000])
CRASH_AT = st.sampled_from(["idle", "intent", "written", "synced"])


class ScheduleMachine(RuleBasedStateMachine):
    prewrite_ms = PREWRITE_MS

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="chronoq-sched-prop-")
        self.clock = None
        self.broker = self.book = None
        # name -> {"spec", "policy", "created", "events": [(kind, at_ms)], "deleted": bool}
        self.model: dict[str, dict] = {}
        self.downs: list[tuple[int, int]] = []  # (crashed at, reopened at)

    @initialize(start=st.sampled_from(STARTS), first=st.lists(st.tuples(st.integers(0, len(SPECS) - 1), POLICIES),
                                                           min_size=1, max_size=3))
    def start(self, start, first):
        self.clock = FakeClock(start)
        self._open()
        self.broker.create_topic(TOPIC, 2)
        for which, policy in first:
            self.create(which, policy)

    def _open(self):
        self.broker = open_broker(self.dir, self.clock, timer_prewrite_ms=self.prewrite_ms)
        self.book = ScheduleBook(self.broker, horizon_ms=HORIZON_MS, ahead_max=8, catch_up_max=3)

    def teardown(self):
        if self.broker is not None and not self.broker.closed:
            self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ----------------------------------------------------------------- driving time like the runtime
    def _due_work(self) -> None:
        now = self.clock.wall_ms()
        for _ in range(200):
            r = self.book.next_round_ms()
            t = self.broker.timer_next_deadline_ms()
            if r is not None and r <= now:
                self.book.run_round_here()
            elif t is not None and t <= now:
                self.broker.timer_tick()
            else:
                return
        raise AssertionError("due work never ends")

    def _advance(self, ms: int) -> None:
        target = self.clock.wall_ms() + ms
        for _ in range(10_000):
            self._due_work()
            now = self.clock.wall_ms()
            if now >= target:
                return
            nxt = [d for d in (self.book.next_round_ms(), self.broker.timer_next_deadline_ms()) if d is not None]
            self.clock.set(min([target] + [max(now + 1, d) for d in nxt]))
        raise AssertionError("too many deadlines")

    # ----------------------------------------------------------------- rules
    @precondition(lambda self: any(n not in self.model for n in NAMES))
    @rule(which=st.integers(0, len(SPECS) - 1), policy=POLICIES)
    def create(self, which, policy):
        name = next(n for n in NAMES if n not in self.model)
        tz, cron, interval = SPECS[which]
        s = self.book.create(name, TOPIC, cron=cron, interval_ms=interval, tz=tz, catch_up=policy,
                             body=f"tick {name}", tag="t", keys=[name], properties={"k": "v"})
        self.model[name] = {"spec": s.spec, "policy": policy, "created": self.clock.wall_ms(), "events": [],
                            "deleted": False}
        self._due_work()

    def _live(self):
        return [n for n, m in self.model.items() if not m["deleted"]]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def pause_or_resume(self, data):
        name = data.draw(st.sampled_from(self._live()))
        s = self.book.get(name)
        now = self.clock.wall_ms()
        if s.paused:
            self.book.resume(name)
            self.model[name]["events"].append(("resume", now))
        else:
            self.book.pause(name)
            self.model[name]["events"].append(("pause", now))
        self._due_work()

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(self._live()))
        self.book.delete(name)
        self.model[name]["deleted"] = True
        self.model[name]["events"].append(("delete", self.clock.wall_ms()))

    @rule(ms=STEP_MS)
    def advance(self, ms):
        self._advance(ms)

    @rule(at=CRASH_AT, down_ms=st.sampled_from([0, 1_000, 30_000, 20 * 60_000, 3 * 3_600_000]),
          lose_unsynced=st.booleans())
    def crash_and_restart(self, at, down_ms, lose_unsynced):
        book, broker = self.book, self.broker
        if at != "idle":
            if book.intent is not None:
                book.run_round_here()
            self.clock.set(max(self.clock.wall_ms(), (book.next_round_ms() or self.clock.wall_ms())))
            rnd = book.begin_round()
            if rnd is not None:
                book.save()
                if at in ("written", "synced"):
                    book.write_round(rnd)
                if at == "synced":
                    broker.flush()
        log = broker.store.log
        if lose_unsynced and log.written > log.synced and log.segments[-1].base <= log.synced:
            log.truncate_active(log.synced - log.segments[-1].base)
        crashed_at = self.clock.wall_ms()
        crash(broker)
        self.clock.advance(down_ms)
        self._open()
        self.downs.append((crashed_at, self.clock.wall_ms()))
        self._due_work()

    # ----------------------------------------------------------------- the model
    def _delivered(self) -> Counter:
        got = Counter()
        now = self.clock.wall_ms()
        for m in visible(self.broker, TOPIC):
            at = int(m.properties[PROP_SCHEDULE_AT])
            assert at <= now, f"occurrence {at} of {m.properties[PROP_SCHEDULE]} visible early at {now}"
            assert m.message_id.endswith(f"-{at}") and m.body == f"tick {m.properties[PROP_SCHEDULE]}".encode()
            got[(m.properties[PROP_SCHEDULE], at)] += 1
        return got

    def _expect(self, name: str, at: int) -> str:
        """'yes' (fires once), 'no' (never), 'maybe' (at most once) for occurrence ``at``."""
        m = self.model[name]
        state = "yes"
        for kind, t in m["events"]:  # the last pause/resume/delete at or before ``at`` decides
            if t >= at:
                break
            state = "yes" if kind == "resume" else ("maybe-end", t)
        if state != "yes":
            _kind, t = state
            return "maybe" if at <= t + self.prewrite_ms + 1 else "no"
        for crashed, reopened in self.downs:
            if crashed < at <= reopened:
                if at <= crashed + HORIZON_MS:
                    if m["policy"] != "skip" and at == self._latest(m, reopened, crashed):
                        return "yes"
                    return "maybe"
                policy = m["policy"]
                if policy == "skip":
                    return "no"
                if policy == "once":
                    return "yes" if at == self._latest(m, reopened, crashed) else "no"
                return "yes" if at in occ.latest_at_or_before(m["spec"], reopened, crashed, 3) else "maybe"
        return "yes"

    @staticmethod
    def _latest(m, upto, after):
        got = occ.latest_at_or_before(m["spec"], upto, after, 1)
        return got[0] if got else None

    @invariant()
    def exactly_once(self):
        if self.broker is None:
            return
        got = self._delivered()
        self.seen_total = len(got)
        for key, n in got.items():
            assert n == 1, f"occurrence {key} delivered {n} times"
        now = self.clock.wall_ms()
        for name, m in self.model.items():
            for at in occ.latest_at_or_before(m["spec"], now, m["created"], 10_000):
                want = self._expect(name, at)
                fired = got.get((name, at), 0)
                if want == "yes":
                    assert fired == 1, f"{name} occurrence {at} ({_iso(at)}) did not fire ({m['policy']}, {m['events']}, downs {self.downs})"
                elif want == "no":
                    assert fired == 0, f"{name} occurrence {at} ({_iso(at)}) fired but should not ({m['policy']}, {m['events']}, downs {self.downs})"
            for (n, at) in got:
                if n == name:
                    assert at > m["created"], f"{name} fired {at} before it was created"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat()


ScheduleMachine.TestCase.settings = settings(max_examples=int(os.environ.get("CHRONOQ_SCHED_EXAMPLES", "25")),
                                             stateful_step_count=30, deadline=None,
                                             suppress_health_check=list(HealthCheck))
TestSchedules = ScheduleMachine.TestCase
