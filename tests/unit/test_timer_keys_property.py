"""Property: replace by key and cancel by key mixed with plain sends, recalls, reschedules, crashes
and clock jumps (``TimerMachine`` of test_timer_property.py, with keyed rules added).

The model keeps, per message, its replace key and message keys. On top of the base machine's
invariants (nothing early, nothing twice, nothing recalled visible):

* a replacing send answers ``replaced:<id>`` for the one pending message holding its key (and
  that message is then cancelled: it never becomes visible), or ``none`` / ``already_delivered:``
  when none is pending; inside the prewrite window the old one may count as delivered instead;
* at most one message per replace key is pending at any time;
* cancel by key cancels exactly the pending messages carrying the key (outside the prewrite
  window; inside it, either), and each one it lists as delivered is due or held;
* all of that while the key index is partly built after a restart (``key_index_build_step``
  reads one bucket into it; removals happen before and after a bucket is read).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from chronoq.core import errors
from chronoq.timer.keyed import REPLACE_PROP
from tests.unit.test_timer_property import DELAYS, TimerMachine
from tests.unit.timerkit import TOPIC

REPLACE_KEYS = st.sampled_from(["r1", "r2", "r3"])
MESSAGE_KEYS = st.sampled_from(["k1", "k2"])


class TimerKeysMachine(TimerMachine):
    def _state(self, m: dict) -> str:
        expect = self._expected(m)
        return "gone" if expect in ("cancelled", "not_found") else expect

    @rule(delay=DELAYS, replace=st.one_of(st.none(), REPLACE_KEYS), key=st.one_of(st.none(), MESSAGE_KEYS))
    def send_keyed(self, delay, replace, key):
        self.count += 1
        due = self._now() + delay
        props = {REPLACE_PROP: replace} if replace else None
        # The messages holding this replace key that may still be pending, before the send.
        holders = {mid: self._state(m) for mid, m in self.model.items()
                   if m.get("replace") == replace and replace and not m["cancelled"]}
        try:
            r = self.broker.send(TOPIC, f"k{self.count}".encode(), deliver_at_ms=due, properties=props,
                                 keys=[key] if key else None)
        except errors.InvalidProperty:
            assert replace and delay <= 0, (replace, delay)
            return
        assert not replace or delay > 0
        self.model[r.message_id] = {"due": due, "handle": r.recall_handle, "cancelled": False, "timer": delay > 0,
                                    "replace": replace, "key": key}
        if replace:
            pending = [mid for mid, s in holders.items() if s == "pending"]
            maybe = [mid for mid, s in holders.items() if s == "pending_or_delivered"]
            assert len(pending) <= 1, holders  # (in the window, an older one may be delivered already)
            kind, _, old = r.replaced.partition(":")
            if pending:
                assert r.replaced == f"replaced:{pending[0]}", (r.replaced, holders)
            elif kind == "replaced":
                assert old in maybe, (r.replaced, holders)
            elif kind == "already_delivered":
                assert holders.get(old) in ("already_delivered", "pending_or_delivered"), (r.replaced, holders)
            else:  # ("none" with a held copy in the window: its copy completed before a restart)
                assert r.replaced == "none", (r.replaced, holders)
            if kind == "replaced":
                self.model[old]["cancelled"] = True
        else:
            assert r.replaced == ""
        self._settle()

    @rule(key=MESSAGE_KEYS)
    def cancel_by_key(self, key):
        carriers = {mid: self._state(m) for mid, m in self.model.items()
                    if m.get("key") == key and m.get("timer") and not m["cancelled"]}
        got = self.broker.cancel_by_key(TOPIC, key)
        cancelled = {mid for mid, _ in got.cancelled}
        delivered = {mid for mid, _ in got.delivered}
        assert not cancelled & delivered
        for mid, state in carriers.items():
            if state == "pending":
                assert mid in cancelled, (mid, got)
            elif state == "already_delivered":
                assert mid not in cancelled, (mid, got)
        for mid in cancelled:
            assert carriers.get(mid) in ("pending", "pending_or_delivered"), (mid, carriers)
            self.model[mid]["cancelled"] = True
        for mid in delivered:
            assert carriers.get(mid) in ("already_delivered", "pending_or_delivered"), (mid, carriers)
        self._settle()

    @rule()
    def key_index_build_step(self):
        # After a restart the first keyed call begins the index build and maintenance reads a
        # bucket file per step: the keyed rules above then run against a partly built index.
        self.broker.timer.keys_step(budget=1)

    @invariant()
    def one_pending_per_replace_key(self):
        by_key: dict = {}
        for mid, m in self.model.items():
            if m.get("replace") and self._state(m) == "pending":
                by_key.setdefault(m["replace"], []).append(mid)
        assert all(len(v) == 1 for v in by_key.values()), by_key


TimerKeysMachine.TestCase.settings = TimerMachine.TestCase.settings
TestTimerKeysMachine = TimerKeysMachine.TestCase
