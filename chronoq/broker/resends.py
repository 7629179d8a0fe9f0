"""Resends: a message whose client id was stored lately, answered with the original's result.

A producer whose answer was lost sends again with the same message id; within the dedupe window
(chronoq.broker.dedupe, which keeps only a hash of (topic, id) and the record's commit offset)
it must get the original's answer, not a second copy. The window only says where to look: the
record is read back (``original``) and must carry this topic and id (a hash collision is another
message), and its body decides between a duplicate and ``errors.DuplicateMessageId``. Inside one
batch a repeated id answers its first occurrence's slot (``deduplicated``), and the batch's answer
is put back together from the slots and the new messages' answers (``merged``).

Only a batch that may hold a resend comes here (``Sender._write_prepared``'s bulk test of the
window); the usual batch never does.
"""

from __future__ import annotations

import logging

from chronoq.broker.dedupe import DedupeWindow
from chronoq.broker.outgoing import Sent
from chronoq.core import errors
from chronoq.core.model import Message, SendResult
from chronoq.store import record
from chronoq.store.store import Columns, Prepared, Store
from chronoq.timer.service import TimerService

# (the send path's logger, as before this part had a module of its own: operators filter on it)
log = logging.getLogger("chronoq.broker.broker")


def original(store: Store, timer: TimerService, window: DedupeWindow, topic: str, message_id: str, body: bytes,
             key_hash: int, now: int) -> SendResult | None:
    """The original result if (topic, id), whose key hashes to ``key_hash``, was stored within
    the window with this body; None if not (a new message). The window keeps only a hash and a
    commit offset: each candidate's record is read back and must carry this topic and id (a hash
    collision is another message, not a duplicate); its body decides duplicate or
    ``DuplicateMessageId``, and its fields rebuild the original answer."""
    for commit_offset in window.candidates(key_hash, now):
        try:
            stored = store.read_record_at(commit_offset)
        except (errors.NotFound, errors.CorruptionError) as exc:
            # The record is gone (retention deleted its segment inside the window) or damaged:
            # there is no original to answer with, so the entry counts as gone and the resend
            # is stored anew (at least once, as after the window).
            if isinstance(exc, errors.CorruptionError):
                log.warning("dedupe: record at %d unreadable (%s); resend of %s stored anew",
                            commit_offset, exc, message_id)
            continue
        if stored.topic != topic or stored.message_id != message_id:
            continue
        if stored.body != body:
            raise errors.DuplicateMessageId(
                f"message id {message_id} was already used in topic {topic} for a different body")
        return _result_of(timer, stored)
    return None


def _result_of(timer: TimerService, m: Message) -> SendResult:
    """The answer the send gave when it stored ``m`` (read back from the log), as a duplicate."""
    if not m.deliver_at_ms:
        return SendResult(m.message_id, m.topic, m.queue_id, m.queue_offset, m.commit_offset, duplicate=True)
    # A delayed send: the timer's answer (recall handle; the real topic of a delay-level copy).
    props = record.encode_properties(m.properties) if m.properties else b""
    p = Prepared(m.topic, m.queue_id, m.flags, m.born_ms, m.deliver_at_ms, m.message_id.encode(), b"", b"",
                 props, b"")
    result = timer.send_result(p, m.message_id, m.commit_offset, m.queue_offset)
    result.duplicate = True
    return result


def deduplicated(store: Store, timer: TimerService, window: DedupeWindow, cols: Columns, ids: list[str],
                 chosen: list[bool], key_hashes: list[int], now: int) -> tuple[list, Columns, list[str], list[int]]:
    """A batch that may hold a resend, message by message: (the answer slots, and the columns,
    ids and key hashes of the new messages). Slot i of the answer: None = new (the next written
    record), an int = the slot whose resend it is (inside the batch), else the original's result
    (from the window)."""
    answers: list[SendResult | int | None] = []
    keep: list[int] = []
    # (topic, id) -> (its slot, its body): a resend inside the batch answers that slot.
    first_in_batch: dict[tuple[str, str], tuple[int, bytes]] = {}
    for i, (topic, mid, c, h, body) in enumerate(zip(cols.topics, ids, chosen, key_hashes, cols.bodies)):
        if c:
            key = (topic, mid)
            first = first_in_batch.get(key)
            if first is not None:
                if first[1] != body:  # same rule as ``original``'s, inside a batch
                    raise errors.DuplicateMessageId(
                        f"message id {mid} is used twice in this batch for different bodies")
                answers.append(first[0])
                continue
            dup = original(store, timer, window, topic, mid, body, h, now)
            if dup is not None:
                answers.append(dup)
                continue
            first_in_batch[key] = (len(answers), body)
        answers.append(None)
        keep.append(i)
    kept = Columns(*([column[i] for i in keep] for column in cols))
    return answers, kept, [ids[i] for i in keep], [key_hashes[i] for i in keep]


def merged(answers: list, fresh: Sent) -> Sent:
    """The whole batch's answer from its slots (``deduplicated``) and the new messages' one."""
    taken = iter(fresh.results())
    out: list[SendResult] = []
    for answer in answers:
        if answer is None:
            result = next(taken)
        elif isinstance(answer, int):
            first = out[answer]
            result = SendResult(first.message_id, first.topic, first.queue_id, first.queue_offset,
                                first.commit_offset, duplicate=True, recall_handle=first.recall_handle)
        else:
            result = answer
        out.append(result)
    return Sent.of(out)
