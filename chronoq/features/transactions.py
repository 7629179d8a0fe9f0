"""Transactional (half) messages: stored invisibly, published on commit, dropped on rollback.

A half message is written to the system topic ``CHRONOQ_TXN_HALF`` (one queue) carrying the real
topic in a reserved property, so consumers of the real topic never see it. Its transaction id is
its offset in that queue (hex). Resolving it writes, in one batch and so under one fsync:

* on COMMIT, a copy into the real topic (same message id, body, tag, keys, user properties, born
  time), then an op record; on ROLLBACK, only the op record;
* the op record goes to ``CHRONOQ_TXN_OP`` (one queue); its body is ``C`` or ``R`` followed by
  the half offset as 8 little-endian bytes.

The copy is written before the op record, so a torn batch can publish twice (retry) but never
lose a committed message. Unresolved halves are checked with a producer of their topic after
``txn_check_after_ms``, then every ``txn_check_interval_ms``, and rolled back after
``txn_max_checks`` checks.

Each pending half costs memory (a ``Half`` and its ``pending`` slot: 280-310 bytes measured with
tracemalloc, docs/security.md) and time in every check pass, so at most
``max_pending_transactions`` are admitted: a new half past it is refused (``TooManyRequests``)
before anything is written; halves being written count too (``_admitted``), so concurrent sends
cannot overshoot. Halves restored from the log at start are all kept whatever the limit (durable
state is never dropped), and ending a transaction is never refused: it is what frees room.

State file ``transactions.json`` (``fsutil.write_json``): ``{"half_floor": n, "op_read": m}``:
every half below ``half_floor`` is resolved, and ``op_read`` is the first op written after the
half at ``half_floor`` (an op follows its half in the log, so every op that resolves a half at
or above the floor is at or after it; ops before it may resolve such halves too, which is why
it is not simply the op queue's end). Start-up replays only those tails of the two queues. It
is derived data (docs/storage.md): without the file both queues are replayed whole.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
from dataclasses import dataclass

from chronoq.core import errors, fsutil, model, validate
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.model import Message, MessageType, SendResult

log = logging.getLogger("chronoq.features.transactions")

HALF_TOPIC = "CHRONOQ_TXN_HALF"
OP_TOPIC = "CHRONOQ_TXN_OP"
STATE_FILE = "transactions.json"
PROP_REAL_TOPIC = "__TXN_TOPIC"
_OP = struct.Struct("<cQ")


@dataclass(slots=True)
class Half:
    offset: int
    topic: str
    message_id: str
    stored_ms: int
    checks: int = 0
    next_check_ms: int = 0


class Transactions:
    def __init__(self, broker: Broker):
        self.broker = broker
        cfg = broker.config
        self.check_after_ms = cfg.txn_check_after_ms
        self.check_interval_ms = cfg.txn_check_interval_ms
        self.max_checks = cfg.txn_max_checks
        self.max_pending = cfg.max_pending_transactions
        self._admitted = 0  # halves admitted by half_messages whose write has not been accounted
        broker.create_topic(HALF_TOPIC, 1, system=True)
        broker.create_topic(OP_TOPIC, 1, system=True)
        self.pending: dict[int, Half] = {}
        self._path = os.path.join(broker.data_dir, STATE_FILE)
        self._write_lock = threading.Lock()
        self._load()
        broker.add_retention_guard(self._retention_floor)

    # ----------------------------------------------------------------- state
    def _load(self) -> None:
        state = fsutil.read_state(self._path, log, "transaction state", "replaying both queues")
        half_floor = int(state.get("half_floor", 0))
        # min: files written before op_read meant "after the floor half" named the op queue's end.
        op_read = min(int(state.get("op_read", 0)), self._op_floor(half_floor))
        resolved: set[int] = set()
        for msg in self._read_all(OP_TOPIC, op_read):
            _, half_offset = _OP.unpack(msg.body)
            resolved.add(half_offset)
        self._op_next = self.broker.queue_bounds(OP_TOPIC, 0)[1]
        for msg in self._read_all(HALF_TOPIC, half_floor):
            if msg.queue_offset not in resolved:
                self._track(msg)
        self._half_next = self.broker.queue_bounds(HALF_TOPIC, 0)[1]
        if len(self.pending) >= self.max_pending:
            log.warning("%d pending transactions restored, max_pending_transactions is %d: all are kept, "
                        "new transactional sends are refused until commits, rollbacks or checks bring "
                        "them below it", len(self.pending), self.max_pending)

    def _read_all(self, topic: str, start: int):
        offset = max(start, self.broker.queue_bounds(topic, 0)[0])
        while True:
            batch = self.broker.read(topic, 0, offset, 1000)
            yield from batch.messages
            if batch.next_offset <= offset:
                return
            offset = batch.next_offset

    def _track(self, msg: Message) -> None:
        # (intern: a restored half would otherwise hold its own copy of its topic's name, ~55 bytes)
        self.pending[msg.queue_offset] = Half(
            msg.queue_offset, sys.intern(msg.properties.get(PROP_REAL_TOPIC, "")), msg.message_id, msg.stored_ms,
            next_check_ms=msg.stored_ms + self.check_after_ms)

    def checkpoint(self) -> None:
        self.write_state(self.checkpoint_state())

    def checkpoint_state(self) -> dict:
        """The state file's content now (on the loop; the runtime's check loop writes it with
        ``write_state`` on a worker thread)."""
        floor = min(self.pending, default=self.broker.queue_bounds(HALF_TOPIC, 0)[1])
        return {"half_floor": floor, "op_read": self._op_floor(floor)}

    def write_state(self, state: dict) -> None:
        """Write the state file (any thread; one writer at a time, so a stop's last checkpoint
        lands after a worker's earlier one)."""
        with self._write_lock:
            fsutil.write_json(self._path, state)

    def _op_floor(self, half_floor: int) -> int:
        """The first op written after the half at ``half_floor`` (the op queue's end when there
        is none): a binary search of the op queue by commit offset."""
        broker = self.broker
        lo, hi = broker.queue_bounds(OP_TOPIC, 0)
        written = broker.entry_commit_offset(HALF_TOPIC, 0, half_floor)
        if written is None:
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if broker.queue_entries(OP_TOPIC, 0, mid, 1)[0][0] > written:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _retention_floor(self) -> int | None:
        if not self.pending:
            return None
        first = min(self.pending)
        return self.broker.entry_commit_offset(HALF_TOPIC, 0, first)

    # ----------------------------------------------------------------- API
    def half_message(self, msg: OutgoingMessage) -> OutgoingMessage:
        """``half_messages`` of one message."""
        return self.half_messages([msg])[0]

    def half_messages(self, msgs: list[OutgoingMessage]) -> list[OutgoingMessage]:
        """The system-topic records that stand for ``msgs`` until they are resolved, admitted as
        a whole or refused as a whole (``TooManyRequests``: ``max_pending_transactions`` would be
        passed). Ensures: the caller then writes them and calls ``accepted`` (written) or
        ``abandoned`` (not written), so the admission is accounted exactly once."""
        halves = [self._half(msg) for msg in msgs]  # every message valid before any is admitted
        held = len(self.pending) + self._admitted
        if held + len(halves) > self.max_pending:
            raise errors.TooManyRequests(
                f"{held} transactions are pending (neither committed nor rolled back), the limit is "
                f"max_pending_transactions ({self.max_pending}); end some (commit or rollback) and "
                "send again later, or raise max_pending_transactions")
        self._admitted += len(halves)
        return halves

    def abandoned(self, halves: list[OutgoingMessage]) -> None:
        """Halves admitted by ``half_messages`` that were not written (the write failed)."""
        self._settle(halves)

    def _settle(self, halves: list[OutgoingMessage]) -> None:
        self._admitted -= len(halves)
        assert self._admitted >= 0, f"more halves settled than admitted ({self._admitted})"

    def _half(self, msg: OutgoingMessage) -> OutgoingMessage:
        # Validates the real topic; a new one is only planned (the commit's copy creates it), so
        # a half refused for another field creates nothing.
        topic = self.broker._send_topic(msg.topic, False, {})
        if msg.message_group:
            raise errors.MessageTypeMismatch("a transactional message cannot have a message group")
        if topic.message_type not in (MessageType.MIXED, MessageType.TRANSACTION):
            raise errors.MessageTypeMismatch(
                f"topic {topic.name} accepts {topic.message_type.name} messages, not TRANSACTION")
        props = validate.properties(msg.properties)
        props[PROP_REAL_TOPIC] = topic.name
        return OutgoingMessage(HALF_TOPIC, msg.body, tag=msg.tag, keys=msg.keys, properties=props,
                               message_id=msg.message_id, born_ms=msg.born_ms)

    def accepted(self, results: list[SendResult], halves: list[OutgoingMessage]) -> list[str]:
        """Register durable half messages (admitted by ``half_messages``); return their transaction ids."""
        self._settle(halves)  # the admission ends: from here they count in ``pending``
        ids = []
        now = self.broker.clock.wall_ms()
        for result, half in zip(results, halves):
            if not result.duplicate and result.queue_offset not in self.pending:
                self.pending[result.queue_offset] = Half(
                    result.queue_offset, half.properties[PROP_REAL_TOPIC], result.message_id, now,
                    next_check_ms=now + self.check_after_ms)
            ids.append(format(result.queue_offset, "x"))
        return ids

    def pending_half(self, topic: str, message_id: str, transaction_id: str) -> Half:
        """The pending half an EndTransaction names (``errors.InvalidTransaction`` when none):
        what an answer of "not known yet" is checked against; it changes nothing."""
        return self._lookup(topic, message_id, transaction_id)

    def _lookup(self, topic: str, message_id: str, transaction_id: str) -> Half:
        try:
            offset = int(transaction_id, 16)
        except (TypeError, ValueError):
            raise errors.InvalidTransaction(f"transaction id {transaction_id!r} is malformed") from None
        half = self.pending.get(offset)
        if half is None:
            raise errors.InvalidTransaction(
                f"transaction {transaction_id} is unknown or already resolved (committed, rolled back or expired)")
        if half.message_id != message_id or (topic and half.topic != topic):
            raise errors.InvalidTransaction(
                f"transaction {transaction_id} belongs to message {half.message_id} of topic {half.topic}")
        return half

    def resolution_batch(self, topic: str, message_id: str, transaction_id: str,
                         commit: bool) -> tuple[Half, list[OutgoingMessage], list[bool]]:
        """Validate an EndTransaction and return the records to write (copy?, op) and their system flags."""
        half = self._lookup(topic, message_id, transaction_id)
        out: list[OutgoingMessage] = []
        system: list[bool] = []
        if commit:
            stored = self.broker.entry_record(HALF_TOPIC, 0, half.offset)
            if stored is None:
                raise errors.InvalidTransaction(f"half message of transaction {transaction_id} is gone")
            props = {k: v for k, v in stored.properties.items() if not k.startswith(model.SYSTEM_PROPERTY_PREFIX)}
            out.append(OutgoingMessage(half.topic, stored.body, tag=stored.tag, keys=stored.keys,
                                       properties=props, message_id=stored.message_id, born_ms=stored.born_ms,
                                       message_type=MessageType.TRANSACTION))
            system.append(False)
        out.append(OutgoingMessage(OP_TOPIC, _OP.pack(b"C" if commit else b"R", half.offset)))
        system.append(True)
        return half, out, system

    def resolved(self, half: Half) -> None:
        self.pending.pop(half.offset, None)

    def end(self, topic: str, message_id: str, transaction_id: str, commit: bool) -> None:
        """Embedded, synchronous EndTransaction (the gRPC shell uses the two steps above)."""
        half, batch, system = self.resolution_batch(topic, message_id, transaction_id, commit)
        if commit:
            self.broker.write([batch[0]])
        self.broker.write([batch[-1]], system=True)
        self.broker.flush()
        self.resolved(half)

    def due_checks(self, now_ms: int, halves: list[Half] | None = None) -> tuple[list[tuple[Half, Message]], list[Half]]:
        """Halves to check with a producer now, and halves past ``max_checks`` (to roll back):
        of ``halves`` (a slice of a ``list(pending.values())`` taken earlier: the runtime's check
        loop reads each due half's record a slice at a time, 50,000 due at once took 0.34 s in
        one call; one resolved since is skipped), or of every pending half."""
        to_check: list[tuple[Half, Message]] = []
        expired: list[Half] = []
        pending = self.pending
        for half in list(pending.values()) if halves is None else halves:
            if half.next_check_ms > now_ms or pending.get(half.offset) is not half:
                continue
            if half.checks >= self.max_checks:
                expired.append(half)
                continue
            entries = self.broker.queue_entries(HALF_TOPIC, 0, half.offset, 1)
            if not entries:
                expired.append(half)
                continue
            half.checks += 1
            half.next_check_ms = now_ms + self.check_interval_ms
            to_check.append((half, self.broker.read_record(entries[0][0], entries[0][1])))
        return to_check, expired

    def expiry(self, half: Half) -> OutgoingMessage:
        """The ROLLBACK op record of a half past ``max_checks``: write it, make it durable, then
        ``resolved(half)`` (the runtime's check loop: ``chronoq.server.consumers``)."""
        log.warning("transaction %x (message %s, topic %s) unresolved after %d checks: rolled back",
                    half.offset, half.message_id, half.topic, half.checks)
        return OutgoingMessage(OP_TOPIC, _OP.pack(b"R", half.offset))

    def expire(self, half: Half) -> None:
        """Embedded, synchronous ``expiry``."""
        self.broker.write([self.expiry(half)], system=True)
        self.broker.flush()
        self.resolved(half)
