"""The broker's consumer-side state, opened beside it by the runtime and shared by every front end:
the ``PopService`` (in-flight books, POP log, groups, with the config file's ``[groups]`` applied)
and the transactions' book of unresolved halves (``Transactions``), and the runtime's loops over
them (``ConsumerLoops``).

Why here and not in a front end: they are the broker's state, not the gRPC server's; the admin
service, the console and the metrics read the same objects, and a second front end must not make a
second set. The loops are the runtime's too: the POP ticker (revives, invisible-time ends, POP-log
flushes) and the transaction checks run once per broker whatever the front ends; a front end only
registers what it adds (``ConsumerLoops.attach``): waking its parked long polls, expiring its
receive answers, pushing a transaction check to a producer over its Telemetry streams.

The POP service's I/O shell (``perform``, ``forward_to_dlq``): the retry and dead-letter copies its
ticks and forwards return (``PopEffects``) are written here and made durable by the committer's
thread (no fsync on the event loop), and only then handed back to the POP service. A transaction
rolled back for want of an answer is written the same way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from chronoq.core import errors, validate
from chronoq.features.transactions import Transactions
from chronoq.pop.service import PopEffects, PopService

log = logging.getLogger("chronoq.runtime")

_GROUP_KEYS = {"fifo": bool, "max_attempts": int}
TICK_MAX_S = 0.5   # the POP ticker runs at least this often (front ends' answer expiry rides on it)
TXN_SCAN_S = 1.0   # how often unresolved transactions are looked at
TXN_SLICE = 512    # halves looked at per slice of a pass (each due one's record is read: ~7 us)


def open_consumers(broker, config) -> tuple[PopService, Transactions]:
    """(the POP service, the transactions' book) of an open broker; nothing stays open on failure."""
    from chronoq.replication.role import pop_generation_floor

    pop = PopService(broker, push_invisible_ms=config.push_invisible_ms, auto_renew_max_ms=config.auto_renew_max_ms,
                     generation_floor=pop_generation_floor(config.data_dir))
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


class ConsumerLoops:
    """The POP ticker and the transaction-check loop of one broker (tasks on the runtime's loop).

    A front end ``attach``es ``woken`` (messages came back: wake parked long polls), ``each_pass``
    (called on every ticker pass) and ``check`` (push a transaction check to a producer; True when
    one took it), and calls ``kick`` when a POP deadline may have moved earlier."""

    def __init__(self, pop: PopService, txns: Transactions, committer, clock) -> None:
        self.pop = pop
        self.txns = txns
        self.committer = committer
        self.clock = clock
        self._kick = asyncio.Event()
        self._attached: list[tuple[Callable[[], None], Callable[[], object], Callable[..., Awaitable[bool]]]] = []
        self.tasks: list[asyncio.Task] = []
        self._remove_log = None

    def start(self) -> list[asyncio.Task]:
        """Start both loops; from now on the committer's thread fsyncs the POP log, right after
        the commit log (``GroupCommitter.add_log``), and the POP service hears of it on the loop."""
        pop, committer = self.pop, self.committer
        self._remove_log = committer.add_log(pop.sync_log)
        pop.attach_syncer(lambda: committer.after_durable(lambda _synced, _exc: pop.log_synced()))
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._tick_loop(), name="chronoq-pop-ticker"),
                      loop.create_task(self._txn_loop(), name="chronoq-txn-checks")]
        return self.tasks

    def close(self) -> None:
        """Stop both loops (each stops at its next await; neither touches the state after it)."""
        for task in self.tasks:
            task.cancel()
        if self._remove_log is not None:  # the POP service syncs its own log from now on (close)
            self.pop.attach_syncer(None)
            self._remove_log()
            self._remove_log = None

    def attach(self, woken: Callable[[], None], each_pass: Callable[[], object],
               check: Callable[..., Awaitable[bool]]) -> Callable[[], None]:
        """Register a front end's parts; returns the function that removes them."""
        entry = (woken, each_pass, check)
        self._attached.append(entry)
        return lambda: self._attached.remove(entry) if entry in self._attached else None

    def kick(self) -> None:
        """A POP deadline may be earlier now (a short change-invisible-time): tick at once."""
        self._kick.set()

    def _woken(self) -> None:
        for woken, _pass, _check in self._attached:
            woken()

    async def _tick_loop(self) -> None:
        pop, clock, kick, committer = self.pop, self.clock, self._kick, self.committer
        failures = 0
        while True:
            kick.clear()  # before the tick: a kick during it makes the next wait end at once
            try:
                for _woken, each_pass, _check in list(self._attached):
                    each_pass()
                effects = pop.tick()
                if effects.handled:
                    self._woken()
                perform(pop, committer, effects, self._woken)
                deadline_ms = effects.next_deadline_ms
                failures = 0
            except Exception:  # noqa: BLE001 - keep ticking; the next pass retries (log a streak's first)
                if failures % 120 == 0:
                    log.exception("POP tick failed (%d times in a row)", failures + 1)
                failures += 1
                deadline_ms = None
            delay = TICK_MAX_S
            if deadline_ms is not None:
                delay = min(TICK_MAX_S, max(0.001, (deadline_ms - clock.wall_ms()) / 1000))
            try:
                await asyncio.wait_for(kick.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _txn_loop(self) -> None:
        """Check unresolved half messages with a producer of their topic; roll back the hopeless
        (their op record made durable by the committer before they count as resolved)."""
        txns, committer = self.txns, self.committer
        saved = None
        storage_fault = None  # the storage error last reported: a full disk is said once, not per pass
        while True:
            await asyncio.sleep(TXN_SCAN_S)
            try:
                now, halves = self.clock.wall_ms(), list(txns.pending.values())
                for start in range(0, len(halves), TXN_SLICE):  # the loop is let go between slices
                    checks, expired = txns.due_checks(now, halves[start:start + TXN_SLICE])
                    for half, message in checks:
                        await self._check(half, message)
                    if expired:
                        txns.broker.write([txns.expiry(half) for half in expired], system=True)
                        await committer.durable(committer.store.log.written)
                        for half in expired:
                            txns.resolved(half)
                    await asyncio.sleep(0)
                state = (len(txns.pending), min(txns.pending, default=-1))
                if state != saved:  # persist the replay floor only when it moved (fsync off the loop)
                    await asyncio.get_running_loop().run_in_executor(None, txns.write_state, txns.checkpoint_state())
                    saved = state
                if storage_fault is not None:
                    log.warning("transaction checks work again (storage recovered)")
                    storage_fault = None
            except (errors.StorageError, OSError) as exc:  # e.g. disk full: retried each pass, said once
                if str(exc) != storage_fault:
                    log.warning("transaction check pass failed, retrying every %.0f s: %s", TXN_SCAN_S, exc)
                    storage_fault = str(exc)
            except Exception:  # noqa: BLE001 - keep checking; the next pass retries
                log.exception("transaction check pass failed")

    async def _check(self, half, message) -> None:
        for _woken, _pass, check in list(self._attached):
            if await check(half, message):
                return
        log.debug("no producer connected to check transaction %x of topic %s", half.offset, half.topic)


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
