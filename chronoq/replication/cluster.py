"""The cluster-wide keys in etcd: read them, watch them, write a topic's placement.

Beside ``chronoq.replication.etcd`` (one group's session: lease, leader key, in-sync set), and
through its connection: these coroutines run on the coordinator's own loop (``coord.call``). The
keys and the policy are ``chronoq.replication.placement`` (pure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid

from chronoq.core import errors, fsutil
from chronoq.replication import placement as pl

log = logging.getLogger("chronoq.replication.cluster")

WRITE_ATTEMPTS = 8   # a placement write lost to another writer is computed again this many times
REREAD_S = 5.0       # the watched snapshot is read again this often even without an event
RETRY_S = 0.25       # a placement write waits this long after etcd failed to answer


async def read(coord) -> pl.Snapshot:
    """Every key under ``/chronoq/<cluster>/`` at one revision."""
    kv = await coord._kv()
    found = await kv.get_prefix(pl.cluster_prefix(coord.cluster))
    return pl.parse(coord.cluster, found.header.revision, [(m.key, m.value, m.mod_revision) for m in found])


async def watch(coord, deliver) -> None:
    """Call ``deliver(snapshot)`` (on this loop; it must not block) now and after every change
    under the cluster's prefix (changes close together are read once), and every ``REREAD_S``;
    runs until cancelled. The watch is created before each read, so no change is missed."""
    changed = asyncio.Event()

    async def follow(w) -> None:
        async for _event in w:
            changed.set()

    while True:
        w = task = waiter = None
        try:
            kv = await coord._kv()
            w = await kv.watch_prefix(pl.cluster_prefix(coord.cluster))
            task = asyncio.ensure_future(follow(w))
            while not task.done():
                changed.clear()
                deliver(await read(coord))
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait([waiter, task], timeout=REREAD_S, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            task.result()  # (a watch that ended: raise why, then start again)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - etcd unreachable for a moment: watch again
            log.warning("watching cluster %s in etcd failed (%r); again in 1 s", coord.cluster, exc)
            await asyncio.sleep(1)
        finally:
            for pending in (task, waiter):
                if pending is not None:
                    pending.cancel()
            if w is not None:
                try:
                    await w.cancel()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass


async def write_placement(coord, topic: str, compute) -> pl.Placement:
    """Write ``compute(snapshot)`` (a ``Placement``, or raise a refusal) as ``topic``'s record, in a
    transaction comparing the record's mod revision with the snapshot's; lost to another writer,
    or etcd slow to answer: read and compute again (a transaction that timed out but was applied
    is then found written: nothing to change). Returns the record as written (its revision set)."""
    key = pl.topic_key(coord.cluster, topic)
    why = "it kept changing under this writer"
    for _ in range(WRITE_ATTEMPTS):
        try:
            snap = await read(coord)
        except Exception as exc:  # noqa: BLE001 - etcd busy or reconnecting: again
            why = f"etcd did not answer ({type(exc).__name__}: {exc})"
            await asyncio.sleep(RETRY_S)
            continue
        existing = snap.placements.get(topic)
        new = compute(snap)  # (a refusal raises here)
        if existing is not None and new.encode() == existing.encode():
            return existing  # (nothing to change: idempotent)
        try:
            kv = await coord._kv()
            ok, _answers = await kv.transaction(
                compare=[kv.transactions.mod(key) == (existing.revision if existing is not None else 0)],
                success=[kv.transactions.put(key, new.encode())], failure=[])
        except Exception as exc:  # noqa: BLE001 - maybe applied: the next read tells
            why = f"etcd did not answer ({type(exc).__name__}: {exc})"
            await asyncio.sleep(RETRY_S)
            continue
        if ok:
            return pl.Placement(new.topic, new.message_type, new.groups, new.draining, snap.revision + 1)
    raise errors.TooManyRequests(f"the placement of {topic} was not written in {WRITE_ATTEMPTS} attempts: {why}; "
                                 "try again")


async def claim_group(coord, data_dir: str, now_ms: int) -> str:
    """Check this node's group name against the group's identity in etcd (``placement.claim``):
    record it when the group is new, keep it in the data directory's ``cluster.json``; raise
    ``errors.PreconditionFailed`` when the directory belongs to another group or cluster."""
    path = os.path.join(data_dir, pl.IDENTITY_FILE)
    try:
        local = fsutil.read_json(path)
    except ValueError as exc:
        raise errors.CorruptionError(path, 0, str(exc)) from None
    key = pl.identity_key(coord.cluster, coord.group)
    failed = "it kept changing"
    for _ in range(WRITE_ATTEMPTS):
        try:
            kv = await coord._kv()
            got = await kv.get(key)
        except Exception as exc:  # noqa: BLE001 - etcd busy: again
            failed = f"etcd did not answer ({type(exc).__name__}: {exc})"
            await asyncio.sleep(RETRY_S)
            continue
        recorded = json.loads(got.value) if got is not None else None
        identity, why = pl.claim(coord.cluster, coord.group, local, recorded)
        if why:
            raise errors.PreconditionFailed(why)
        if recorded is None:
            if local is not None and local.get("id"):  # this directory knew the group: etcd forgot it
                log.warning("etcd holds no identity for broker group %s of cluster %s, which this data directory "
                            "records (id %s): etcd's data was lost or replaced; recording it again. Topic "
                            "placements live in etcd only: check `chronoq cluster groups` (docs/cluster.md)",
                            coord.group, coord.cluster, local.get("id"))
            identity = identity or uuid.uuid4().hex
            try:
                created, _ = await kv.transaction(
                    compare=[kv.transactions.version(key) == 0],
                    success=[kv.transactions.put(key, json.dumps({"id": identity, "created_ms": now_ms}).encode())],
                    failure=[])
            except Exception as exc:  # noqa: BLE001 - maybe applied: the next read tells
                failed = f"etcd did not answer ({type(exc).__name__}: {exc})"
                await asyncio.sleep(RETRY_S)
                continue
            if not created:
                continue  # another node of the group recorded it first: check against that
        if local is None or local.get("id") != identity:
            os.makedirs(data_dir, exist_ok=True)
            fsutil.write_json(path, {"cluster": coord.cluster, "group": coord.group, "id": identity})
        return identity
    raise errors.ClientError(f"the identity of broker group {coord.group} could not be checked in etcd ({failed}): "
                             "this node does not start without it")


def read_once(access, cluster: str, timeout_s: float = 5.0) -> pl.Snapshot:
    """The cluster read once without a lease (tools, tests): ``access`` an ``EtcdAccess`` or plain
    endpoints. Runs its own event loop: call it from a thread that has none running."""
    from chronoq.replication.etcd import read_view

    return read_view(access, cluster, "reader", timeout_s, reading=read)
