"""POP consumption over the embedded broker: receive, ack, change-invisible-time, revive, DLQ.

The facade and shell around the pure core (``inflight.py`` books, ``handle.py`` receipt
handles, ``names.py`` rules, ``poplog.py`` durable format). It reads and writes messages through
the ``Broker`` API and owns two files: ``groups.json`` (``groups.py``: group settings) and
``pop/<generation>.poplog`` (the durable CK/ACK log; when it is flushed and compacted:
``journal.py``). Its parts: ``reading.py`` (what a receive reads from one queue), ``copies.py``
(retry and dead-letter copies, the consumer's view of one), ``handout.py`` (a receive's pass over
the queues: which messages go into which new CK), ``reports.py`` (lag, in flight),
``revive.py`` (retry, dead-letter or redeliver what timed out), ``renew.py`` (auto-renew
rules); this module receives, settles and ticks.

How a message moves
-------------------
receive    For each queue of the topic (rotating start) and of the group's retry topic
           (read first on every ``RETRY_SAMPLE_EVERY``-th receive, otherwise only to fill the
           batch, so neither starves): read from the group's pop offset, skip messages the tag
           filter rejects, stop at a retry message whose back-off has not ended, and record one
           CK per queue with the pop time and invisible deadline.
ack        settles the entry in its CK (bitmap).
change     settles the old entry and opens a successor CK with the new deadline; the old
           handle is stale from then on.
tick       revives CKs whose invisible time ended. Concurrent groups: unsettled entries are
           copied to ``%RETRY%{group}_{topic}`` (``names.py``); ``tick`` returns the copies as
           effects (``PopEffects``), the shell writes them and has them fsynced (the runtime:
           the committer's thread, ``server/consumers.py``; embedded: ``tick_durably``), and
           only then is the CK dropped (``copies_durable``); an entry whose delivery attempt reached ``max_attempts`` goes to
           ``%DLQ%{group}`` instead. FIFO groups: the entries are redelivered *in place* (same
           queue and offset, attempt + 1) so the order of a message group holds; a queue with a
           FIFO CK in flight hands out nothing (RocketMQ locks the queue the same way).
FIFO DLQ   ``forward_to_dlq_effects`` copies the message to ``%DLQ%{group}``; once the shell
           made the copy durable, ``copies_durable`` settles it (embedded: ``forward_to_dlq``).
auto-renew a push receive's CKs are extended in place at their deadline instead of revived while
           their client is alive, up to ``auto_renew_max_ms`` (rules in ``renew.py``).

Durability and the merge buffer
-------------------------------
A new CK lives only in memory (RocketMQ's PopBufferMergeService). If it is fully acked within
``buffer_ms`` nothing is ever written. Otherwise it is appended to the POP log (with its
bitmap so far) once its lineage is ``buffer_ms`` old; later acks of a logged CK are appended as
ACK records. The log is flushed (one write + fsync) at most ``flush_interval_ms`` after the
first unflushed record, from ``tick`` (``next_deadline_ms`` includes that deadline); under the
runtime the write and fsync run on the committer's thread, right after the commit log's
(``attach_syncer``, ``journal.py``).

The group's consume offset (``Broker.commit_offset``) advances only past messages that are
acked, filtered out, revived (their retry copy fsynced), or covered by a CK whose record is
fsynced (``inflight.py`` I1/I2). A restart reads the queue again from the persisted consume
offset, skipping offsets that CKs in the log cover (the *skip set*, carried into snapshots).

Crash guarantee (``kill -9``, or power loss: everything relied on is fsynced). With
``B = buffer_ms + flush_interval_ms + Broker checkpoint_interval_ms`` (defaults
2 s + 0.1 s + 1 s = 3.1 s, plus any lateness of the shell in calling ``tick`` at
``next_deadline_ms`` and ``Broker.maintenance``), after a crash at time T:

- no message is lost: every message not acked is delivered again, at once if its CK was not yet
  durable, else when its invisible time ends (CKs recovered from the log are revived like any
  other);
- a message acked before ``T - B`` is never delivered again; one acked within ``B`` before T
  may be, once (its ACK record, or the consume offset past it, was not yet durable);
- a change-invisible-time made within ``B`` before T may be lost: the message then becomes
  visible at its earlier deadline (or at once);
- revives and dead-letter moves are not repeated: the retry/DLQ copies are fsynced, then
  ``copies_durable`` logs the CK (if it was still only in memory) with its DONE/ACK records and fsyncs the POP
  log before returning. Only a crash between those two fsyncs writes a copy twice.

Why B: a CK's lineage (it and its change-invisible/FIFO successors) is logged ``buffer_ms``
after its first pop and fsynced ``flush_interval_ms`` later. From then on either its ACK
records are durable, or every lower offset of the queue is safe (popped earlier, so logged
earlier) and the consume offset passes the message; the broker persists that within its
``checkpoint_interval_ms``. Offsets a restart must not read again (covered by CKs in the log,
including finished ones) are kept in the skip set and carried into every snapshot.

Back-off: the table is the broker's delay levels (``BrokerConfig.timer_delay_levels``, read at
construction into ``retry_delays_ms`` and each ``GroupConfig``). A retry message carries
``__NOT_BEFORE_MS`` = ``max(revive time, failed delivery's start + delay of level
min(attempt, levels))`` and waits at the head of its retry queue (one queue per back-off level,
see ``names.retry_queue``; the topic grows when the table does), the way a delay level waits,
without a copy through the timer's schedule log (docs/timers.md).

Long polling: ``receive`` never blocks. The shell waits for a broker arrival, or for
``tick().handled`` or ``copies_durable`` returning > 0 (messages revived, dead-lettered, due for FIFO redelivery, or a retry
queue's head whose back-off ended), and arms one timer at ``next_deadline_ms()``. Call
``close()`` before ``Broker.close()``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from chronoq.core import errors, validate
from chronoq.broker.broker import Broker
from chronoq.core.clock import Clock
from chronoq.pop import journal, names, poplog, renew, reports
from chronoq.pop import handle as handles
from chronoq.pop.counters import PopCounters
from chronoq.pop.groups import GroupBook, GroupConfig
from chronoq.pop.handout import HandOut, Popped
from chronoq.pop.inflight import Checkpoint, Inflight, QueueState
from chronoq.pop.recentacks import RecentAcks
from chronoq.pop.revive import Revival, Reviver

log = logging.getLogger("chronoq.pop")

BUFFER_MS = 2_000             # merge buffer: a CK younger than this is not written
FLUSH_INTERVAL_MS = 100       # unflushed POP-log records wait at most this long
RETRY_SAMPLE_EVERY = 5        # every 5th receive reads the retry topic first
TICK_CKS_MAX = 4_096          # CKs one tick revives (the rest next tick, at once) ...
# ... and messages: each is read and copied on the loop (~20 us), and a CK holds up to 32, so
# 4,096 CKs were up to 131,072 messages in one tick (40,000 due at once held the loop 0.8 s).
# 512 is ~10 ms a tick; the server's ticker comes back 1 ms later while more are due.
TICK_ENTRIES_MAX = 512
PUSH_INVISIBLE_MS = 60_000    # auto-renew receives without an invisible time: the renew slice
AUTO_RENEW_MAX_MS = 3 * 3600 * 1000  # auto-renew stops this long after the receive (the proxy's 3 h)
_NAMES_CACHE_MAX = 10_000


@dataclass(slots=True)
class PopEffects:
    """What ``tick`` or ``forward_to_dlq_effects`` asks of its shell. With ``revival``: write its
    copies (``write_copies``), make them durable (the committer, or ``Broker.flush``), then call
    ``copies_durable``. ``handled`` > 0: wake long polls (more may follow from ``copies_durable``);
    ``next_deadline_ms``: when to tick again (None: nothing waits)."""
    handled: int = 0
    revival: Revival | None = None
    next_deadline_ms: int | None = None


@dataclass
class PopService(HandOut):
    def __init__(self, broker: Broker, clock: Clock | None = None, *, buffer_ms: int = BUFFER_MS,
                 flush_interval_ms: int = FLUSH_INTERVAL_MS, push_invisible_ms: int = PUSH_INVISIBLE_MS,
                 auto_renew_max_ms: int = AUTO_RENEW_MAX_MS, retry_delays_ms: tuple[int, ...] | None = None,
                 generation_floor: int = 0):
        """``retry_delays_ms``: the retry back-off table; None (the rule): the broker's
        ``timer_delay_levels``. ``generation_floor``: the POP log opens at a generation past it
        (a promoted replica: past every generation its old primary may have minted handles in)."""
        if buffer_ms < 0 or flush_interval_ms < 0:
            raise errors.ClientError("buffer_ms and flush_interval_ms must not be negative")
        names.check_receive_invisible(push_invisible_ms)
        if not 0 <= auto_renew_max_ms <= renew.MAX_MS_LIMIT:
            raise errors.ClientError(f"auto_renew_max_ms must be 0 to {renew.MAX_MS_LIMIT}, not {auto_renew_max_ms}")
        self.renewals = renew.Renewals(push_invisible_ms, auto_renew_max_ms)
        self.counters = PopCounters()  # for chronoq.server.metrics
        self._pruned_ms = 0
        self.broker = broker
        self.retry_delays_ms = (broker.config.delay_levels_ms() if retry_delays_ms is None
                                else names.check_retry_delays(retry_delays_ms))
        self.clock = clock or broker.clock
        self.buffer_ms = buffer_ms
        self.flush_interval_ms = flush_interval_ms
        self.data_dir = broker.data_dir
        self.pop_dir = os.path.join(self.data_dir, poplog.POP_DIR)
        self._groups = GroupBook(self.data_dir, self.retry_delays_ms, broker.config.max_groups)
        self.max_subscriptions = broker.config.max_subscriptions  # group/topic pairs tracked (handout.py)
        self._turns: dict[tuple[str, str], int] = {}
        self._blocked: set[QueueState] = set()   # retry queues whose head waits out a back-off
        self._topic_names: set[str] = set()      # names validated by ack/change (not created)
        self.closed = False
        now = self.clock.wall_ms()
        recovered = poplog.load(self.pop_dir)
        self.recovery = recovered
        generation = max(recovered.generation, generation_floor) + 1
        self._inflight = Inflight(None, generation=generation, buffer_ms=buffer_ms)
        self._recent_acks = RecentAcks()  # a repeated ack answers OK (recentacks.py)
        restored = self._restore(recovered)
        logf = poplog.PopLog.create(self.pop_dir, generation, restored, now,
                                    journal.skips(self._inflight))
        self._inflight.sink = logf
        self._journal = journal.PopJournal(broker, self._inflight, logf, self.pop_dir, flush_interval_ms)
        self._reviver = Reviver(broker, self.clock, self._groups, self._inflight, self.counters, self._journal)
        if restored or recovered.truncated_bytes:
            log.info("POP state recovered: %d checkpoints in flight, %d bytes of torn tail dropped",
                     len(restored), recovered.truncated_bytes)

    # ----------------------------------------------------------------- groups (groups.py)
    def group(self, name: str) -> GroupConfig:
        """The group's settings; an unknown (valid) group is created with the defaults."""
        return self._groups.get(name)

    def is_fifo(self, name: str) -> bool:
        """Whether ``name`` is a FIFO group (an unknown one is not, and is not created)."""
        cfg = self._groups.peek(name)
        return cfg is not None and cfg.fifo

    def set_group(self, name: str, *, fifo: bool | None = None, max_attempts: int | None = None) -> GroupConfig:
        """Change a group's settings (durable). Unnamed settings keep their value."""
        return self._groups.set(name, fifo=fifo, max_attempts=max_attempts)

    def list_groups(self) -> list[GroupConfig]:
        return self._groups.list()

    # ----------------------------------------------------------------- receiving
    def receive(self, group: str, topic: str, *, max_messages: int, invisible_ms: int | None,
                tag_filter: str = "*", attempt_id: str | None = None, client_id: str = "",
                auto_renew: bool = False) -> list[Popped]:
        """Hand out up to ``max_messages`` visible messages; [] when none (never blocks).

        ``auto_renew`` (push consumers): the broker keeps the messages invisible, in slices of
        ``invisible_ms`` (None: ``push_invisible_ms``), until they are acked or nacked, the
        client goes away, or ``auto_renew_max_ms`` has passed (``renew.py``).

        Ensures: each message is in exactly one new CK, invisible until ``invisible_until_ms``.
        """
        self._check_open()
        if invisible_ms is None:
            if not auto_renew:
                raise errors.InvalidInvisibleTime("a receive without auto-renew needs an invisible time")
            invisible_ms = self.renewals.slice_ms
        names.check_max_messages(max_messages)
        names.check_receive_invisible(invisible_ms)
        tags = names.parse_tag_filter(tag_filter)
        attempt_id = names.check_attempt_id(attempt_id)
        if group not in self._groups:
            validate.group_name(group)  # before the topic: a bad request creates nothing
        # Validates; unknown: TopicNotFound. Never created here (as in RocketMQ, consumers create no
        # topics: a misspelt name would leave a topic behind and poll it empty for ever).
        tcfg = self.broker.topic(topic, create=False)
        gcfg = self._groups.get(group)
        # Timer copies become visible at the timer's tick at their due time (the runtime's timer
        # loop wakes for the earliest hold: ``Broker.timer_next_deadline_ms``), not here.
        now = self.clock.wall_ms()
        inflight = self._inflight
        key = None
        if attempt_id is not None:
            key = (client_id, group, topic, attempt_id)
            again = inflight.recall_attempt(key, now)
            if again is not None:
                return again
        turn = self._turns.get((group, topic), 0)
        self._turns[(group, topic)] = turn + 1
        rcfg = self.broker.topics.get(names.retry_topic(group, topic))
        self._check_subscription(group, tcfg.name, rcfg.name if rcfg is not None else None)
        out: list[Popped] = []
        refs: list[tuple[Checkpoint, int]] = []
        retry_first = rcfg is not None and turn % RETRY_SAMPLE_EVERY == 0
        if retry_first:
            self._pop_topic(gcfg, topic, rcfg, out, refs, max_messages, now, invisible_ms, None, 0, True)
        if len(out) < max_messages:
            self._pop_topic(gcfg, topic, tcfg, out, refs, max_messages, now, invisible_ms, tags, turn, False)
        if len(out) < max_messages and rcfg is not None and not retry_first:
            self._pop_topic(gcfg, topic, rcfg, out, refs, max_messages, now, invisible_ms, None, 0, True)
        if key is not None and out:
            inflight.remember_attempt(key, out, refs)
        if out:
            received, key = self.counters.received, (group, topic)
            received[key] = received.get(key, 0) + len(out)
        if auto_renew and out:
            self._renew_for(refs, client_id, now)
        self._journal.after(now)
        if self.broker.trace is not None and out:  # chronoq.broker.trace: buffered, no I/O here
            self.broker.trace.delivered(group, out, refs, now)
        return out

    def _check_subscription(self, group: str, *topics: str | None) -> None:
        """Refuse a receive that would start tracking group/topic pairs past ``max_subscriptions``
        before it hands anything out (``_queue_state`` refuses the same, as a backstop)."""
        pairs = self._inflight.pairs
        new = sum(1 for t in topics if t is not None and (group, t) not in pairs)
        if new and len(pairs) + new > self.max_subscriptions:
            raise errors.ClientError(
                f"group {group!r} reading topic {topics[0]!r} not started: the broker tracks max_subscriptions "
                f"({self.max_subscriptions}) group/topic pairs; delete unused groups (chronoq group delete) "
                "or raise max_subscriptions")

    def _renew_for(self, refs: list, client_id: str, now: int) -> None:
        until = self.renewals.until(client_id, now)
        last = None
        for ck, _ in refs:  # refs run CK by CK
            if ck is not last and until > ck.deadline_ms:
                self._inflight.renew_for(ck, client_id, until)
            last = ck

    def client_seen(self, client_id: str) -> None:
        """The client is alive (a heartbeat): its auto-renew receives go on being renewed."""
        self.renewals.seen(client_id, self.clock.wall_ms())

    def client_gone(self, client_id: str) -> None:
        """The client terminated: its messages are no longer renewed; they revive at their
        current deadline unless acked first."""
        self.renewals.gone(client_id)

    # ----------------------------------------------------------------- settling
    def _locate(self, group: str, topic: str, receipt_handle: str) -> tuple[Checkpoint, int]:
        self._check_names(group, topic)
        ck_id, index, qid, offset = handles.decode(receipt_handle)
        return self._inflight.find(ck_id, index, qid, offset, group, topic), index

    def _check_names(self, group: str, topic: str) -> None:
        self._check_open()
        if group not in self._groups:
            validate.group_name(group)
        if topic not in self._topic_names:
            validate.topic_name(topic)
            if len(self._topic_names) > _NAMES_CACHE_MAX:
                self._topic_names.clear()
            self._topic_names.add(topic)

    def ack(self, group: str, topic: str, receipt_handle: str) -> None:
        """Settle one delivery. InvalidReceiptHandle if unknown, stale, or already revived (an
        ack repeated within the delivery's invisible time is answered as done: recentacks.py)."""
        failure = self.ack_many(group, topic, (receipt_handle,))[0]
        if failure is not None:
            raise failure

    def ack_many(self, group: str, topic: str, receipt_handles) -> list[Exception | None]:
        """``ack`` each handle, in order, with the bookkeeping after them (consume offsets) done
        once for all. Per handle: None when settled, else the error ``ack`` would have raised."""
        out: list[Exception | None] = []
        now = self.clock.wall_ms()
        receipt_handles = list(receipt_handles)
        settled_refs = []  # (checkpoint, index) of each settled handle, for the trace
        decode, find, settle = handles.decode, self._inflight.find, self._inflight.settle
        recent = self._recent_acks
        try:
            try:
                self._check_names(group, topic)  # _locate's checks, once for all handles
            except Exception as exc:  # noqa: BLE001 - every handle fails as ack would
                out += [exc] * len(receipt_handles)
                return out
            for handle in receipt_handles:
                try:
                    ck_id, index, qid, offset = decode(handle)
                except Exception as exc:  # noqa: BLE001 - per handle, as ack would raise it
                    out.append(exc)
                    continue
                try:
                    ck = find(ck_id, index, qid, offset, group, topic)
                    settle(ck, index)
                except errors.InvalidReceiptHandle as exc:
                    # (acked already, within its invisible time: answered as done; not counted)
                    out.append(None if recent.repeated(ck_id, index, group, topic, now) else exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - per handle, as ack would raise it
                    out.append(exc)
                    continue
                recent.add(ck_id, index, group, topic, ck.deadline_ms)
                settled_refs.append((ck, index))
                out.append(None)
        finally:
            if self.broker.trace is not None and settled_refs:  # chronoq.broker.trace: buffered, no I/O here
                self.broker.trace.acked(group, settled_refs, now)
            self._journal.after(now)
            settled = len(settled_refs)  # (not out.count(None): a repeated ack is answered, not counted)
            if settled:
                acked, key = self.counters.acked, (group, topic)
                acked[key] = acked.get(key, 0) + settled
        return out

    def change_invisible(self, group: str, topic: str, receipt_handle: str, invisible_ms: int) -> str:
        """Make the message invisible for ``invisible_ms`` from now; returns the NEW handle.

        The old handle is stale from now on. The delivery attempt does not change.
        """
        names.check_change_invisible(invisible_ms)
        ck, index = self._locate(group, topic, receipt_handle)
        now = self.clock.wall_ms()
        new = self._inflight.change(ck, index, now, invisible_ms)
        nacked, key = self.counters.nacked, (group, topic)
        nacked[key] = nacked.get(key, 0) + 1
        self._journal.after(now)
        return handles.encode(new.ck_id, 0, new.queue.queue_id, new.offsets[0])

    def forward_to_dlq_effects(self, group: str, topic: str, receipt_handle: str) -> PopEffects:
        """The client gives up (FIFO): the copy to ``%DLQ%{group}`` for the shell to write and
        make durable; ``copies_durable`` then settles the message (the handle is stale at once)."""
        ck, index = self._locate(group, topic, receipt_handle)
        return PopEffects(0, self._reviver.plan_forward(ck, index), None)

    def forward_to_dlq(self, group: str, topic: str, receipt_handle: str) -> None:
        """``forward_to_dlq_effects`` performed at once on this thread (the embedded path)."""
        effects = self.forward_to_dlq_effects(group, topic, receipt_handle)
        if not self.write_copies(effects):
            raise errors.StorageError("the dead-letter copy could not be written; try again")
        try:
            self.broker.flush()
        except errors.ChronoqError as exc:
            self.copies_durable(effects, exc)
            raise
        self.copies_durable(effects)

    # ----------------------------------------------------------------- the shell's part of effects
    def write_copies(self, effects: PopEffects) -> bool:
        """Write the effects' copies (page cache). False: a storage error; the revive is
        postponed (a forward: nothing changed) and there is nothing more to do."""
        revival = effects.revival
        return revival is None or not revival.copies or self._reviver.write(revival)

    def copies_durable(self, effects: PopEffects, exc: BaseException | None = None) -> int:
        """The effects' copies are durable (``exc``: their fsync failed): finish the revive or
        forward; returns how many messages it handed back (> 0: wake long polls)."""
        if effects.revival is None:
            return 0
        handled = self._reviver.durable(effects.revival, exc)
        self._journal.after(self.clock.wall_ms())
        return handled

    def attach_syncer(self, request: Callable[[], None] | None) -> None:
        """Have the POP log fsynced elsewhere: ``request()`` asks for ``sync_log`` to run (on any
        thread, e.g. the committer's fsync thread) and ``log_synced`` to follow on this thread. None:
        fsync on this thread (the embedded default)."""
        self._journal.request_sync = request

    def sync_log(self) -> None:
        """Write and fsync the POP log's sealed records (thread-safe; ``attach_syncer``)."""
        self._journal.sync_current()

    def log_synced(self) -> None:
        """After ``sync_log`` (on the service's thread): its CKs count as durable."""
        if not self.closed:
            self._journal.synced()

    def tick_durably(self, now: int | None = None) -> int:
        """``tick`` with its effects performed at once on this thread (the embedded path, no
        committer): copies written and fsynced (``Broker.flush``) before the revive completes.
        Returns how many messages were handed back (> 0: wake long polls)."""
        effects = self.tick(now)
        handled = effects.handled
        if effects.revival is not None and self.write_copies(effects):
            try:
                self.broker.flush()
            except errors.ChronoqError as exc:
                self.copies_durable(effects, exc)
            else:
                handled += self.copies_durable(effects)
        return handled

    # ----------------------------------------------------------------- time
    def tick(self, now: int | None = None) -> PopEffects:
        """Revive CKs whose invisible time ended; flush the POP log when due; commit offsets.

        Returns the effects for the shell: the retry and dead-letter copies to write durably
        (then ``copies_durable``), how many messages are handed back now (FIFO redeliveries,
        retry heads whose back-off ended: > 0 wakes long polls) and the next deadline.
        """
        self._check_open()
        now = self.clock.wall_ms() if now is None else now
        inflight = self._inflight
        handled = 0
        revival = None
        due = inflight.due(now, TICK_CKS_MAX, TICK_ENTRIES_MAX)
        if due:
            due = self._renew(due, now)
        if due:
            revival = self._reviver.plan(due, now)
            if not revival.copies:  # FIFO redeliveries in place only: nothing to make durable first
                handled += self._reviver.complete(revival)
                revival = None
        if self._blocked:
            for qs in [qs for qs in self._blocked if qs.blocked_until <= now]:
                qs.blocked_until = 0
                self._blocked.discard(qs)
                handled += 1
        inflight.age(now)
        self._journal.flush(now, force=False)
        self._journal.commit()
        self._journal.maybe_compact(now)
        return PopEffects(handled, revival, self.next_deadline_ms())

    def _renew(self, due: list[Checkpoint], now: int) -> list[Checkpoint]:
        """Extend the due CKs that auto-renew (``renew.py``); returns the others, to revive."""
        renewals = self.renewals
        if now - self._pruned_ms > renewals.client_silence_ms:
            renewals.prune(now)
            self._pruned_ms = now
        out = []
        for ck in due:
            deadline = renewals.extend(ck.client_id, ck.renew_until_ms, now) if ck.renew_until_ms else None
            if deadline is None:
                out.append(ck)
            else:
                self._inflight.extend(ck, deadline)
        return out

    def next_deadline_ms(self) -> int | None:
        """When ``tick`` next has work: the earliest invisible-time end, merge-buffer or flush
        deadline, or retry back-off end. None when nothing waits."""
        best = self._inflight.next_deadline()
        flush_at = self._journal.flush_deadline()
        if flush_at is not None:
            best = flush_at if best is None else min(best, flush_at)
        for qs in self._blocked:
            if best is None or qs.blocked_until < best:
                best = qs.blocked_until
        return best

    # ----------------------------------------------------------------- recovery
    def _restore(self, recovered: poplog.Recovered) -> list[Checkpoint]:
        """Rebuild the in-flight table from the log; returns the CKs for the new snapshot."""
        inflight = self._inflight
        for (group, topic, qid), offsets in recovered.seen.items():
            qs = self._queue_state(group, topic, qid, recovered=True)
            qs.skip.update(o for o in offsets if o >= qs.pop_offset)
        out = []
        for rec in recovered.cks.values():
            qs = self._queue_state(rec.group, rec.popped, rec.queue_id, recovered=True)
            out.append(inflight.restore(qs, rec.ck_id, rec.topic, rec.offsets, rec.attempts, rec.pop_ms,
                                        rec.delivered_ms, rec.deadline_ms, rec.bits, rec.fifo, rec.named))
        return out

    # ----------------------------------------------------------------- reporting and lifecycle
    def lag(self, group: str, topic: str) -> int:
        """Messages of ``topic`` (and the group's retry copies) this group has not popped yet."""
        return reports.lag(self.broker, self._inflight, group, topic)

    def inflight_count(self) -> int:
        """Deliveries handed out and not yet settled (for metrics and tests)."""
        return reports.inflight_count(self._inflight)

    def inflight_by_topic(self) -> dict[tuple[str, str], int]:
        """Deliveries handed out and not yet settled per (group, topic the consumer asked for);
        ``reports.inflight_by_topic``."""
        return reports.inflight_by_topic(self._inflight)

    def consumed_topics(self, inflight: dict[tuple[str, str], int] | None = None) -> dict[str, set[str]]:
        """group -> the existing user topics it consumes: POP state in memory (``inflight_by_topic``,
        passed in when the caller has it) or a committed offset. ``group list`` and the lag gauge."""
        if inflight is None:
            inflight = self.inflight_by_topic()
        return reports.consumed_topics(self.broker, inflight)

    def check(self) -> None:
        """Verify the in-flight invariants (``inflight.py``); for tests."""
        self._inflight.check()

    def _check_open(self) -> None:
        if self.closed:
            raise errors.ClosedError("the POP service is closed")

    def close(self) -> None:
        """Persist state: log every in-flight CK, fsync, hand consume offsets to the broker."""
        if self.closed:
            return
        if self._reviver.pending:  # copies written, their fsync not reported yet: finish them here
            try:
                self.broker.flush()
            except errors.ChronoqError as exc:
                log.error("closing the POP service: retry and dead-letter copies not durable: %s", exc)
            else:
                for revival in list(self._reviver.pending):
                    self.copies_durable(PopEffects(0, revival))
        now = self.clock.wall_ms()
        self._inflight.age(now, everything=True)  # in-flight CKs stay invisible across a restart
        self._journal.close(now)
        self.closed = True

    def abandon(self) -> None:
        """Stop without persisting anything more (what ``kill -9`` leaves; for crash tests)."""
        self._journal.log.abandon()
        self.closed = True
