"""What an operator changes in POP state (``chronoq group reset-offset``, ``group delete``,
``topic delete``; the rules are ``chronoq.features.operations``): move a group's read position,
drop the state of a group or of a topic's queues, and rewrite the POP log after either, so a
restart does not bring back what was dropped. Runs on the service's thread like every POP call.
"""

from __future__ import annotations

from chronoq.core import errors
from chronoq.pop.service import PopService


def reset_position(pop: PopService, group: str, topic: str, qid: int, offset: int) -> int | None:
    """The next receive of ``group`` reads ``topic``/``qid`` from ``offset`` (up or down; the
    caller set the consume offset to it: ``Broker.set_offset``). Deliveries in flight stay in
    flight, acked or revived as usual; the queue's restart skip set is dropped (``rewrite_log``
    then makes a rewind hold across a restart). Returns the old read position (None: the group
    had no state for the queue)."""
    pop._check_open()
    qs = pop._inflight.queues.get((group, topic, qid))
    if qs is None:
        return None
    old = qs.pop_offset
    qs.pop_offset = qs.committed = offset
    qs.skip = set()
    qs.blocked_until = 0
    pop._blocked.discard(qs)
    return old


def in_flight(pop: PopService, group: str | None = None, topics: tuple[str, ...] = ()) -> int:
    """Deliveries in flight (handed out, not settled) of ``group`` and/or read from ``topics``."""
    return sum(len(ck.unsettled()) for ck in pop._inflight.cks.values()
               if (group is None or ck.group == group) and (not topics or ck.queue.topic in topics))


def forget(pop: PopService, group: str | None = None, topics: tuple[str, ...] = ()) -> None:
    """Drop the POP state of ``group`` (its settings too, when no ``topics``) and/or of the queues
    of ``topics``. Refused while deliveries of them are in flight: their CKs would be acked and
    revived into state that is gone. Call ``rewrite_log`` after."""
    pop._check_open()
    if in_flight(pop, group, topics):
        raise errors.ClientError("deliveries are in flight; wait until they are acked or their invisible time ends")
    mine = [(key, qs) for key, qs in pop._inflight.queues.items()
            if (group is None or qs.group == group) and (not topics or qs.topic in topics)]
    if any(qs.pending for _key, qs in mine):  # expired FIFO CKs not yet handed out again
        raise errors.ClientError("FIFO deliveries wait to be handed out again; try again in a moment")
    for _key, qs in mine:
        pop._inflight.remove_queue(qs)
        pop._blocked.discard(qs)
    for key in [k for k in pop._turns if (group is None or k[0] == group) and (not topics or k[1] in topics)]:
        del pop._turns[key]
    if group is not None and not topics:
        pop._groups.delete(group)
    pop.counters.forget(group, topics)


def rewrite_log(pop: PopService) -> None:
    """After ``reset_position`` or ``forget``: rewrite the POP log now as a snapshot of the live
    CKs and the skip sets as they are (its older records name offsets a restart would skip).
    Embedded, the new file is made and synced here; in the server the committer's thread makes
    it: the operator is answered once ``log_in_place`` (and a rewrite starts only when it is:
    ``maybe_compact`` does nothing while a new generation waits for its file)."""
    pop._journal.maybe_compact(pop.clock.wall_ms(), force=True)


def log_in_place(pop: PopService) -> bool:
    """Whether the POP log's current generation has its file (no rewrite or compaction waits for
    the committer's thread): after ``rewrite_log``, the snapshot is durable and a restart reads it."""
    return pop._journal.log.made
