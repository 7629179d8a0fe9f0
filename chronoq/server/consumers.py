"""The broker's consumer-side state, opened beside it by the runtime and shared by every front end:
the ``PopService`` (in-flight books, POP log, groups, with the config file's ``[groups]`` applied)
and the transactions' book of unresolved halves (``Transactions``).

Why here and not in a front end: they are the broker's state, not the gRPC server's; the admin
service, the console and the metrics read the same objects, and a second front end must not make a
second set. The gRPC front end only drives them (the POP ticker, transaction checks pushed to
producers over Telemetry).

The POP service's I/O shell (``perform``, ``forward_to_dlq``): the retry and dead-letter copies its
ticks and forwards return (``PopEffects``) are written here and made durable by the committer's
thread (no fsync on the event loop), and only then handed back to the POP service.
"""

from __future__ import annotations

import logging

from typing import Callable

from chronoq.core import errors, validate
from chronoq.features.transactions import Transactions
from chronoq.pop.service import PopEffects, PopService

log = logging.getLogger("chronoq.runtime")

_GROUP_KEYS = {"fifo": bool, "max_attempts": int}


def open_consumers(broker, config) -> tuple[PopService, Transactions]:
    """(the POP service, the transactions' book) of an open broker; nothing stays open on failure."""
    pop = PopService(broker, push_invisible_ms=config.push_invisible_ms, auto_renew_max_ms=config.auto_renew_max_ms)
    try:
        apply_group_config(pop, config.extra.get("groups", {}))
        txns = Transactions(broker)
    except BaseException:
        pop.close()
        raise
    return pop, txns


def close_consumers(pop: PopService | None, txns: Transactions | None) -> None:
    """Persist both (before the broker closes); a failure is logged: the broker must still close."""
    if txns is not None:
        try:
            txns.checkpoint()
        except errors.StorageError as exc:  # e.g. a full disk: start-up replays more
            log.error("could not save the transaction state at stop: %s", exc.message)
    if pop is not None:
        try:
            pop.close()
        except Exception:  # noqa: BLE001 - the broker must still close cleanly after this
            log.exception("closing the POP service failed")


def perform(pop: PopService, committer, effects: PopEffects, woken: Callable[[], None]) -> None:
    """Write the copies of a tick's ``effects`` and have the committer fsync them; once they
    are durable (on the loop) the POP service finishes the revive and ``woken()`` is called if
    messages came back. Never waits."""
    if effects.revival is None or not pop.write_copies(effects):
        return

    def durable(_synced: int, exc: BaseException | None) -> None:
        if pop.closed:
            return  # (``close`` finished the revive itself)
        try:
            if pop.copies_durable(effects, exc):
                woken()
        except Exception:  # noqa: BLE001 - logged; the CKs are postponed or done, the next tick goes on
            log.exception("finishing a POP revive after its fsync failed")

    committer.after_durable(durable)


async def forward_to_dlq(pop: PopService, committer, group: str, topic: str, receipt_handle: str) -> None:
    """ForwardMessageToDeadLetterQueue: the copy is written, fsynced by the committer's thread,
    and only then is the message settled (a failure answers the client and changes nothing)."""
    effects = pop.forward_to_dlq_effects(group, topic, receipt_handle)
    if not pop.write_copies(effects):
        raise errors.StorageError("the dead-letter copy could not be written; try again")
    try:
        await committer.durable(committer.store.log.written)
    except BaseException as exc:
        pop.copies_durable(effects, exc)
        raise
    pop.copies_durable(effects)


def apply_group_config(pop, groups: dict) -> None:
    """Apply ``[groups.<name>]`` tables of the config file (``fifo``, ``max_attempts``)."""
    if not isinstance(groups, dict):
        raise errors.ClientError("[groups] in the config file must be a table of group tables")
    for name, values in groups.items():
        validate.group_name(name)
        if not isinstance(values, dict):
            raise errors.ClientError(f"[groups.{name}] must be a table")
        kwargs = {}
        for key, value in values.items():
            kind = _GROUP_KEYS.get(key)
            if kind is None:
                raise errors.ClientError(f"unknown setting {key!r} in [groups.{name}]; known: "
                                         + ", ".join(sorted(_GROUP_KEYS)))
            if type(value) is not kind:
                raise errors.ClientError(f"[groups.{name}] {key} must be {kind.__name__}, not {value!r}")
            kwargs[key] = value
        pop.set_group(name, **kwargs)
