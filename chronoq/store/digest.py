"""A canonical, comparable view of the store's derived data: the consume queues and their holds.

Consume queues are derived from the commit log (docs/storage.md, "The logs and what is derived
from them"): a queue rebuilt by replaying the log must equal the live one entry for entry. This
is the one definition of "equal" that tests (tests/integration/test_rebuild_from_log.py) and a
follower checking that it applies the leader's log byte for byte (issue 22) compare.

Read-only: it reads queue files and the in-memory holds and changes nothing.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from chronoq.store.consumequeue import ENTRY_SIZE

# Entries read per step (a read never crosses a consume-queue file).
_READ_STEP = 4096


class QueueDigest(NamedTuple):
    min_offset: int
    next_offset: int
    held: tuple[tuple[int, int], ...]  # (queue offset, due ms) of held entries, ascending
    sha256: str  # of the raw 24-byte entries [min_offset, next_offset), as stored


def queue_digest(store) -> dict[str, QueueDigest]:
    """``{"<topic>/<queue id>": QueueDigest}`` for every queue holding at least one entry.

    Queues that never got an entry are left out: whether their (empty) directory exists depends
    on who asked for the queue's next offset, not on the log. Entries are hashed exactly as
    stored (commit offset, size, tag hash, time), so two stores with equal digests hand every
    reader the same records at the same queue offsets.
    """
    out: dict[str, QueueDigest] = {}
    for (topic, queue_id), cq in sorted(store.queues.items()):
        if cq.next_offset <= cq.min_offset and not cq.held:
            continue
        h = hashlib.sha256()
        off = cq.min_offset
        while off < cq.next_offset:
            n = min(_READ_STEP, cq.next_offset - off, cq.per_file - off % cq.per_file)
            raw = cq.read_including_held(off, n)
            assert len(raw) == n * ENTRY_SIZE, f"consume queue {topic}/{queue_id} is short at {off}"
            h.update(raw)
            off += n
        out[f"{topic}/{queue_id}"] = QueueDigest(cq.min_offset, cq.next_offset, tuple(cq.held), h.hexdigest())
    return out
