"""The broker's delayed-delivery operations (a mixin of ``chronoq.broker.broker.Broker``): recall,
reschedule and cancel by key in two halves (the record written, then the answer once its ticket
is durable: ``GroupCommitter`` awaits the fsync off the loop, the embedded calls here make it
durable in place), the timer's tick and its effects, and the timer's read-only views. The timer
itself is ``chronoq.timer.service.TimerService``; this is the facade's side of it.
"""

from __future__ import annotations

from chronoq.core import errors, validate
from chronoq.timer.keyed import KeyAnswer, KeyCancelResult
from chronoq.timer.pending import PendingPage, PendingQuery
from chronoq.timer.recall import RECALLED_NOW
from chronoq.timer.service import Answer, RecallOutcome, RecallResult, RescheduleOutcome, RescheduleResult, Tick


class TimerOperations:
    """Needs from the facade: ``timer``, ``store``, ``clock``, ``trace``, ``recall_outcomes``,
    ``durable`` and ``notify_arrivals``."""

    def recall(self, handle: str) -> RecallResult:
        """Cancel a delayed message by the ``recall_handle`` its send returned (embedded: the wait
        for durability is ``durable``, here; the server's is ``GroupCommitter.recall``).

        The outcome is definite: CANCELLED (durable before this returns; it will never be
        visible), ALREADY_DELIVERED (its time has come: it is or will be visible), NOT_FOUND.
        A malformed handle raises ``ClientError``.
        """
        answer = self.timer_recall(handle)
        self.durable(answer.ticket)
        return self.timer_answered(answer)

    def reschedule(self, handle: str, deliver_at_ms: int) -> RescheduleResult:
        """Move a pending delayed message to ``deliver_at_ms``; the result carries a new handle."""
        answer = self.timer_reschedule(handle, deliver_at_ms)
        self.durable(answer.ticket)
        return self.timer_answered(answer)

    def cancel_by_key(self, topic: str, key: str) -> KeyCancelResult:
        """Cancel every pending timer message of ``topic`` carrying message key ``key``
        (chronoq.timer.keyed): the cancelled ones are durable before this returns."""
        answer = self.timer_cancel_by_key(topic, key)
        self.durable(answer.ticket)
        return self.timer_key_answered(answer)

    def timer_cancel_by_key(self, topic: str, key: str) -> KeyAnswer:
        """``cancel_by_key``'s first half (as ``timer_recall``). The topic must be a user topic
        that exists: a misspelt name would answer "nothing pending", as if all were well."""
        if isinstance(topic, str) and topic:
            topic = validate.user_topic(topic)
            if topic not in self.topics:
                raise errors.TopicNotFound(f"topic {topic!r} does not exist")
        return self.timer.cancel_by_key(topic, key)

    def timer_key_answered(self, answer: KeyAnswer) -> KeyCancelResult:
        """``answer.ticket`` is durable: count and trace the cancelled, return the result."""
        result = answer.result
        now = self.clock.wall_ms()
        for message_id, due_ms in result.cancelled:
            self._count_recall("recall", RecallOutcome.CANCELLED.value)
            if self.trace is not None:
                self.trace.recalled(result.topic, message_id, due_ms, now)
        self.notify_arrivals()
        return result

    def timer_recall(self, handle: str) -> Answer:
        """``recall``'s first half: its record written (page cache), the answer to give once
        ``answer.ticket`` is durable (``GroupCommitter.durable``), then ``timer_answered``."""
        return self.timer.recall(handle)

    def timer_reschedule(self, handle: str, deliver_at_ms: int) -> Answer:
        return self.timer.reschedule(handle, deliver_at_ms)

    def timer_answered(self, answer: Answer) -> RecallResult | RescheduleResult:
        """``answer.ticket`` is durable: trace the outcome, return the result to give."""
        result = answer.result
        kind = "recall" if isinstance(result.outcome, RecallOutcome) else "reschedule"
        self._count_recall(kind, result.outcome.value)
        self.notify_arrivals()
        if self.trace is not None and result.outcome is RecallOutcome.CANCELLED and result.detail == RECALLED_NOW:
            self.trace.recalled(result.topic, result.message_id, result.deliver_at_ms, self.clock.wall_ms())
        elif self.trace is not None and result.outcome is RescheduleOutcome.RESCHEDULED:
            self.trace.rescheduled(result.topic, result.message_id, result.deliver_at_ms, self.clock.wall_ms())
        return result

    def _count_recall(self, kind: str, outcome: str) -> None:
        key = (kind, outcome)
        self.recall_outcomes[key] = self.recall_outcomes.get(key, 0) + 1

    def timer_tick(self, now_ms: int | None = None) -> int:
        """Deliver what is due (bounded work) and wait for it to be durable: the embedded shell
        of the timer (``timer_step``, then its ticket made durable here by ``durable``, the
        broker's synchronous committer, and reported). Returns how many deliveries became visible.
        The server's shell is ``Runtime._timer_loop`` (the committer's thread fsyncs)."""
        tick = self.timer_step(now_ms)
        if not tick.ticket:
            return tick.visible
        try:
            self.durable(tick.ticket)
        except errors.StorageError as exc:
            self.timer_sync_failed(exc, now_ms)
            return tick.visible
        return tick.visible + self.timer_synced(self.store.log.synced, now_ms)

    def timer_step(self, now_ms: int | None = None) -> Tick:
        """The timer's tick (``TimerService.tick``): due copies written (page cache), and its
        effects: deliveries made visible, the ticket to make durable and report to
        ``timer_synced`` (or ``timer_sync_failed``), the next deadline."""
        tick = self.timer.tick(now_ms)
        self.notify_arrivals()
        return tick

    def timer_synced(self, synced_upto: int, now_ms: int | None = None) -> int:
        """The commit log is fsynced and dispatched below ``synced_upto`` (by the committer):
        complete the timer's deliveries. Returns how many became visible."""
        done = self.timer.synced(synced_upto, now_ms)
        self.notify_arrivals()
        return done

    def timer_sync_failed(self, exc: BaseException, now_ms: int | None = None) -> None:
        self.timer.sync_failed(exc, now_ms)

    def timer_next_deadline_ms(self) -> int | None:
        """Epoch ms at which ``timer_tick`` next has work (may be in the past), or None."""
        return self.timer.next_deadline_ms()

    def timer_stats(self, horizon_ms: int = 600_000) -> dict:
        """Lateness histogram, pending counts by due bucket, per-level backlog, lanes (plain dicts)."""
        return self.timer.stats(horizon_ms)

    def pending(self, query: PendingQuery) -> PendingPage:
        """One page of pending delayed messages (topic, key, due window, cursor), in due order:
        ``chronoq.timer.pending`` (docs/timers.md, "Seeing what is pending")."""
        return self.timer.pending(query)

    def pending_span(self) -> tuple[int, int] | None:
        """(first, end) of the pending messages' due times, None when none (for planning)."""
        return self.timer.pending_span()
