"""Property: keyed timers and recurring schedules on one broker, one clock, one set of crashes.

One Hypothesis state machine over everything issue 26 adds to delayed delivery, sharing the real
embedded broker (real files in a temp dir) and its ``FakeClock``:

* sends with and without a replace key and a message key, delay-level sends, recall, reschedule,
  recall of a handle a reschedule replaced, cancel by key, the key index's build one bucket at a
  time after a restart (the rules and model of ``TimerKeysMachine``, test_timer_keys_property.py,
  on topic ``t``);
* recurring schedules, cron and interval, in Europe/Berlin, America/New_York and
  Australia/Lord_Howe from half an hour before a DST transition (both directions), each catch-up
  policy, created, paused, resumed, deleted (the rules and model of ``ScheduleMachine``,
  test_schedules_stateful.py, on topic ``sched``);
* time moving from one deadline to the next (schedule rounds and timer ticks, each run when due),
  ``kill -9`` at each step of a round (with and without losing the commit log's unsynced tail,
  the broker down a while), clean restarts and checkpoints: one broker for both.

After every step, both models' invariants: nothing visible before its time (the timer's early
count stays 0 for everything it delivered), nothing twice, a replaced or cancelled message never,
at most one pending message per replace key, every schedule occurrence exactly once per its
catch-up policy across the DST transitions.

Runs ``CHRONOQ_TIMERS_SM_EXAMPLES`` examples (default 50) of ``CHRONOQ_TIMERS_SM_STEPS`` steps
(default 50): about a minute on the development machine. A longer search: raise both.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from chronoq.features.schedules.book import ScheduleBook
from tests.unit.test_schedules_stateful import HORIZON_MS, ScheduleMachine
from tests.unit.test_timer_keys_property import MESSAGE_KEYS, REPLACE_KEYS, TimerKeysMachine
from tests.unit.test_timer_property import DELAYS, LEVELS_MS

SHORT_STEPS = st.sampled_from([0, 1, 999, 1_000, 4_000, 59_999])


class TimersMachine(ScheduleMachine):
    """``ScheduleMachine`` (its broker, clock, crashes and time) with a ``TimerKeysMachine`` riding
    on the same broker: ``self.timers`` holds the keyed timers' model and rules."""

    prewrite_ms = TimerKeysMachine.prewrite_ms
    timers: TimerKeysMachine | None = None

    def _open(self):
        self.broker = TimerKeysMachine._open_at(self.dir, self.clock)
        self.book = ScheduleBook(self.broker, horizon_ms=HORIZON_MS, ahead_max=8, catch_up_max=3)
        if self.timers is None:
            self.timers = TimerKeysMachine(self.broker)
        self.timers.broker = self.broker

    def _timers_ready(self) -> bool:
        return self.timers is not None

    # ----------------------------------------------------------------- the keyed timers' rules
    @precondition(_timers_ready)
    @rule(delay=DELAYS, queue=st.integers(0, 1))
    def send_timer(self, delay, queue):
        self.timers.send_timer(delay, queue)
        self._due_work()

    @precondition(_timers_ready)
    @rule(level=st.integers(1, len(LEVELS_MS)))
    def send_level(self, level):
        self.timers.send_level(level)
        self._due_work()

    @precondition(_timers_ready)
    @rule(delay=DELAYS, replace=st.one_of(st.none(), REPLACE_KEYS), key=st.one_of(st.none(), MESSAGE_KEYS))
    def send_keyed(self, delay, replace, key):
        self.timers.send_keyed(delay, replace, key)
        self._due_work()

    @precondition(_timers_ready)
    @rule(key=MESSAGE_KEYS)
    def cancel_by_key(self, key):
        self.timers.cancel_by_key(key)
        self._due_work()

    @precondition(lambda self: self.timers is not None and self.timers.model)
    @rule(data=st.data())
    def recall(self, data):
        self.timers.recall(data)
        self._due_work()

    @precondition(lambda self: self.timers is not None and self.timers.model)
    @rule(data=st.data(), delay=DELAYS)
    def reschedule(self, data, delay):
        self.timers.reschedule(data, delay)
        self._due_work()

    @precondition(lambda self: self.timers is not None and self.timers.stale)
    @rule(data=st.data())
    def recall_a_replaced_handle(self, data):
        self.timers.recall_a_replaced_handle(data)

    @precondition(_timers_ready)
    @rule()
    def key_index_build_step(self):
        self.timers.key_index_build_step()

    # ----------------------------------------------------------------- the shared broker
    @precondition(_timers_ready)
    @rule(ms=SHORT_STEPS)
    def advance_a_little(self, ms):
        self._advance(ms)

    @precondition(_timers_ready)
    @rule()
    def maintenance(self):
        self.broker.maintenance()
        self.broker.timer.checkpoint()
        self._due_work()

    @precondition(_timers_ready)
    @rule()
    def clean_restart(self):
        self.broker.close()
        self._open()
        self._due_work()

    # ----------------------------------------------------------------- invariants
    @invariant()
    def timers_never_early_nor_twice_nor_cancelled(self):
        if self.timers is not None:
            self.timers.never_early_and_exactly_once()

    @invariant()
    def one_pending_per_replace_key(self):
        if self.timers is not None:
            self.timers.one_pending_per_replace_key()


TimersMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CHRONOQ_TIMERS_SM_EXAMPLES", "50")),
    stateful_step_count=int(os.environ.get("CHRONOQ_TIMERS_SM_STEPS", "50")), deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[p for p in Phase if p is not Phase.explain])  # (explaining a failure here takes minutes)
TestTimersMachine = TimersMachine.TestCase
