"""Group commit for the asyncio shell.

Sends are written to the log on the event loop (page cache, microseconds), then wait for an fsync
that a single flusher task runs in a worker thread. While one fsync runs, every send that arrives is
written and joins the next fsync, so one fsync acknowledges a whole group. Under the ``async``
policy the flusher runs every ``flush_interval_ms`` instead and sends are answered once written
(loss window: the last interval of writes if the machine, not just the process, goes down).

Records become visible to consumers (dispatched) only after the fsync under ``sync``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

from chronoq.core import errors
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.model import SendResult

log = logging.getLogger("chronoq.broker.committer")

DISPATCH_RETRY_S = 0.5  # after a failed dispatch, try again this soon


class GroupCommitter:
    def __init__(self, broker: Broker):
        self.broker = broker
        self.sync_policy = broker.config.flush_policy == "sync"
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.fsyncs = 0
        self._dispatch_failures = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="chronoq-flusher")

    async def send(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        """Write a batch and return once it is acknowledged under the flush policy.

        Every caller is a new send (transactional halves come as ``system``): all are refused
        while the disk is below its reserve.
        """
        self.broker.check_space()
        try:
            results = self.broker.write(messages, system=system)
        except errors.DiskFull:  # the disk filled between looks: look again at the next send
            self.broker.disk.recheck_soon()
            raise
        if results:
            await self._acknowledged()
        return results

    async def send_plain(self, topic: str, message_ids: list[str], tags: list[str], bodies: list[bytes],
                         born_ms: list[int | None]) -> list[int] | None:
        """``send`` through ``Broker.write_plain`` (a batch stored in bulk): the queue offsets once
        acknowledged, or None at once, nothing written, when the batch is not for that path."""
        self.broker.check_space()
        try:
            offsets = self.broker.write_plain(topic, message_ids, tags, bodies, born_ms)
        except errors.DiskFull:
            self.broker.disk.recheck_soon()
            raise
        if offsets:
            await self._acknowledged()
        return offsets

    async def _acknowledged(self) -> None:
        """Return once everything written so far is acknowledged under the flush policy."""
        if not self.sync_policy:
            self.broker.store.dispatch()
            self.broker.notify_arrivals()
            return
        # Duplicates answer with the original's offset; it too must be durable before we reply.
        end = self.broker.store.log.written
        if self.broker.store.log.synced >= end and self.broker.store.dispatched >= end:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((end, fut))
        self._kick.set()
        await fut

    async def barrier(self) -> None:
        """Return once everything written so far is durable and visible (per policy)."""
        store = self.broker.store
        end = store.log.written
        if not self.sync_policy:
            store.dispatch()
            self.broker.notify_arrivals()
            return
        if store.log.synced >= end and store.dispatched >= end:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((end, fut))
        self._kick.set()
        await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.broker.config.flush_interval_ms / 1000
        while True:
            if self.sync_policy:
                await self._kick.wait()
                self._kick.clear()
            else:
                try:
                    await asyncio.wait_for(self._kick.wait(), interval)
                except asyncio.TimeoutError:
                    pass
                self._kick.clear()
            store = self.broker.store
            if store.log.written > store.log.synced:
                try:
                    synced = await loop.run_in_executor(None, store.sync)
                    self.fsyncs += 1
                except Exception as exc:  # fail the waiters; the data is not acknowledged
                    log.error("fsync failed: %s", exc)
                    self._fail_all(exc)
                    continue
            else:
                synced = store.log.synced
            if self.sync_policy:
                self._dispatch(synced)
            self._release(synced)
            if self._closing and not self._waiters:
                return

    def _dispatch(self, synced: int) -> None:
        """Make durable records visible. A failure (a consume-queue write on a full disk) must not
        stop the flusher: the records are durable, so their sends are still acknowledged, and the
        store keeps the undispatched batches, so a retry shortly after makes them visible."""
        try:
            self.broker.store.dispatch(synced)
        except Exception as exc:  # noqa: BLE001 - retried; the flusher must keep running
            self._dispatch_failures += 1
            if self._dispatch_failures % 100 == 1:
                log.error("making written messages visible failed (%d in a row; retrying): %s",
                          self._dispatch_failures, exc)
            asyncio.get_running_loop().call_later(DISPATCH_RETRY_S, self._kick.set)
        else:
            self._dispatch_failures = 0
        self.broker.notify_arrivals()

    def _release(self, synced: int) -> None:
        keep = []
        for end, fut in self._waiters:
            if end <= synced:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((end, fut))
        self._waiters = keep
        if keep:
            self._kick.set()

    def _fail_all(self, exc: Exception) -> None:
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._waiters = []

    async def close(self) -> None:
        self._closing = True
        self._kick.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.broker.flush()
        self._release(self.broker.store.log.synced)
