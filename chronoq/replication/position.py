"""What a replica holds, as positions, and what a primary ships. Small, mostly pure.

A node's replication position is three numbers:

* ``commit``: the commit log's global byte offset (the store's own offsets: a segment named by
  its base offset holds ``[base, base + size)``), the end of what is fsynced on the replica;
* ``pop_generation``, ``pop_offset``: the POP log file ``pop/<generation>.poplog`` the replica
  holds and how many of its bytes.

Shipped, all from what is durable on the primary: the commit log (appended unchanged, in the
segment it belongs to), the POP log (a new generation is shipped whole: it begins with a snapshot),
and the small snapshot files the broker rewrites whole (``SNAPSHOT_FILES``, copied whole when they
change). Everything else in a data directory is derived and rebuilt from these
(docs/storage.md, "The logs and what is derived from them").

Prefix check: a replica at ``commit`` sends the CRC-32C of its last bytes (``TAIL_BYTES`` at
most, within the segment holding them); the primary compares its own bytes there. A replica
past the primary's durable end, or whose tail differs, does not hold a prefix of the primary's
log (another cluster, or a diverged history) and is refused.

The epoch: ``promote`` appends an epoch record (``EPOCH_TOPIC`` queue 0, property ``__EPOCH``) to
the commit log; a node's epoch is the newest such record in its log (0 when there is none: the
first primary). Its consume queue is the epoch history, entry n the start of epoch n + 1.
"""

from __future__ import annotations

import os
import uuid

import google_crc32c

from chronoq.store import record
from chronoq.store.store import Prepared, Store

# Rewritten whole and atomically by their owners (each with a CRC header line): the broker's
# topics (chronoq.broker.topics.TOPICS_FILE), consumer offsets (chronoq.broker.offsets.OFFSETS_FILE),
# POP group settings (chronoq.pop.groups.GROUPS_FILE), recurring schedules
# (chronoq.features.schedules.book.STATE_FILE), published batch ids of staged writes
# (chronoq.features.staging.STATE_FILE) and quarantined log ranges (chronoq.store.commitlog.LOST_FILE).
# tests/unit/test_replication.py holds the names to those constants.
SNAPSHOT_FILES = ("topics.json", "offsets.json", "groups.json", "schedules.json", "staging.json",
                  "commitlog/lost.json")
# Configuration that names no log position: shipped in every answer after it changed, so even a
# replica that never caught up opens with the primary's topics and groups at promotion. The
# others go only with an answer that reaches the durable end (``chronoq.replication.shipper``).
CONFIG_FILES = ("topics.json", "groups.json")
TAIL_BYTES = 4096
EPOCH_TOPIC = "CHRONOQ_EPOCH"
PROP_EPOCH = "__EPOCH"
PROP_NODE = "__NODE"
POP_DIR = "pop"
POP_SUFFIX = ".poplog"


def new_node_id() -> str:
    """A process's identity in pulls (a replica pointed at itself is told so)."""
    return uuid.uuid4().hex[:16]


def tail(store: Store, commit: int) -> tuple[int, int]:
    """``(tail_from, crc)`` of the log's bytes ``[tail_from, commit)``: at most ``TAIL_BYTES``,
    within the segment holding the byte before ``commit``. ``(commit, 0)`` at offset 0."""
    log = store.log
    if commit <= log.min_offset:
        return commit, 0
    seg = log.segment_for(commit - 1)
    start = max(seg.base, commit - TAIL_BYTES)
    return start, google_crc32c.value(log.read(start, commit - start))


def snapshot_version(path: str) -> str:
    """A file's change key: size and modification time (its owner replaces it whole); "" if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def pop_position(data_dir: str) -> tuple[int, int]:
    """``(generation, size)`` of the newest POP log file in ``data_dir`` ((0, 0): none)."""
    directory = os.path.join(data_dir, POP_DIR)
    try:
        names = [n for n in os.listdir(directory) if n.endswith(POP_SUFFIX) and n[:-len(POP_SUFFIX)].isdigit()]
    except FileNotFoundError:
        return 0, 0
    if not names:
        return 0, 0
    newest = max(names, key=lambda n: int(n[:-len(POP_SUFFIX)]))
    return int(newest[:-len(POP_SUFFIX)]), os.path.getsize(os.path.join(directory, newest))


def pop_file(data_dir: str, generation: int) -> str:
    return os.path.join(data_dir, POP_DIR, f"{generation:020d}{POP_SUFFIX}")


# ------------------------------------------------------------------------------------- the epoch
def epoch_record(epoch: int, node_id: str, now_ms: int) -> Prepared:
    """The record a promotion appends: ``EPOCH_TOPIC`` queue 0, a system record (never sent by a user)."""
    assert epoch > 0
    props = record.encode_properties({PROP_EPOCH: str(epoch), PROP_NODE: node_id})
    return Prepared(EPOCH_TOPIC, 0, record.FLAG_SYSTEM, now_ms, 0, f"epoch-{epoch}".encode(), b"", b"", props,
                    f"epoch {epoch}".encode())


def current_epoch(store: Store) -> int:
    """The newest epoch record's number in ``store``'s dispatched log (0: none yet)."""
    return epoch_history(store)[-1][0]


def epoch_history(store: Store) -> list[tuple[int, int]]:
    """``[(epoch, start), ...]`` ascending, ``(0, 0)`` first: each epoch and the commit-log offset of
    its record (``chronoq.replication.divergence`` defines the boundary). Entry n of the epoch
    queue is epoch n + 1 when its record is gone (retention): promotions add one."""
    first, nxt = store.bounds(EPOCH_TOPIC, 0)
    history = [(0, 0)]
    entries: list = []
    while first + len(entries) < nxt:  # (a read never crosses a consume-queue file)
        got = store.entries(EPOCH_TOPIC, 0, first + len(entries), nxt - first - len(entries))
        if not got:
            break
        entries.extend(got)
    for n, (commit_offset, _size, _tag, _t) in enumerate(entries, start=first):
        try:
            epoch = int(store.read_properties(commit_offset).get(PROP_EPOCH, "0"))
        except Exception:  # noqa: BLE001 - the record deleted by retention: the queue's numbering
            epoch = n + 1
        # (offsets ascend, except a first leader's record at offset 0: its log was empty, and
        # epoch 0, the sentinel, holds no bytes)
        if epoch > history[-1][0] and (commit_offset > history[-1][1] or history[-1] == (0, 0)):
            history.append((epoch, commit_offset))
    return history
