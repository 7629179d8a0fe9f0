"""The role a data directory was last given by a promotion, stored: ``role.json``.

The epoch record in the log says *that* a promotion happened, and is copied to every replica;
it cannot say *which* data directory was promoted. This file can: it is written (atomically,
``fsutil.write_json``: a CRC-checked JSON document) by a replica as it is promoted, before the
promotion is answered, and deleted by a follower once it applies a primary's first answer.

    {"version": 1, "role": "primary", "epoch": 3, "was_replica_of": "host-a:8081", "node_id": "...", "at_ms": ...,
     "pop_generation_floor": 1031}

``pop_generation_floor``: the promoted node's POP service opens its log at a generation past it
(``POP_GENERATION_GAP``).

``chronoq serve --replica-of X`` on a directory holding it serves as the primary it became,
saying so (a promoted node's configuration still naming its old primary is the common mistake:
following it again would hand two nodes the same history), unless ``rejoin`` (``--rejoin``) is
set; then it follows X, which must be at a newer epoch (``chronoq.replication.divergence``:
an older one is refused with nothing changed).
"""

from __future__ import annotations

import os

from chronoq.core import fsutil

ROLE_FILE = "role.json"
VERSION = 1
# The promoted node's POP log starts this many generations past the newest it knows of (the
# copied one, or the one the primary last reported: ``PullResponse.pop_generation_now``), so a
# receipt handle the old primary minted in a generation made after its last report (a compaction
# in the moment before it died) never names a checkpoint the promoted node mints. CK ids carry
# the generation in 32 bits (chronoq.pop.inflight): 4 million promotions' worth.
POP_GENERATION_GAP = 1024


def write_promoted(data_dir: str, epoch: int, was_replica_of: str, node_id: str, now_ms: int,
                   pop_generation_floor: int = 0) -> None:
    assert 0 <= pop_generation_floor < 1 << 31, pop_generation_floor
    fsutil.write_json(os.path.join(data_dir, ROLE_FILE), {
        "version": VERSION, "role": "primary", "epoch": epoch, "was_replica_of": was_replica_of,
        "node_id": node_id, "at_ms": now_ms, "pop_generation_floor": pop_generation_floor})


def pop_generation_floor(data_dir: str) -> int:
    """The POP log generation the promoted node's POP service must start past (0: none stored)."""
    doc = promoted(data_dir)
    return int(doc.get("pop_generation_floor", 0)) if doc else 0


def promoted(data_dir: str) -> dict | None:
    """The stored promotion (None: none, or a file this version does not know: ignored, said by the caller)."""
    try:
        doc = fsutil.read_json(os.path.join(data_dir, ROLE_FILE))
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("role") != "primary":
        return None
    return doc


def clear(data_dir: str) -> bool:
    """Forget the promotion (this node follows a primary now). True when there was one."""
    path = os.path.join(data_dir, ROLE_FILE)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsutil.fsync_dir(data_dir)
    return True


def serve_as_primary_message(data_dir: str, replica_of: str) -> str | None:
    """What ``chronoq serve --replica-of`` says when it serves as the primary instead (None: it follows)."""
    doc = promoted(data_dir)
    if doc is None:
        return None
    return (f"this data directory was promoted to primary (epoch {doc.get('epoch')}, it had been a replica of "
            f"{doc.get('was_replica_of') or '?'}): serving as the primary; replica_of = {replica_of} is ignored "
            f"(take it out of the configuration, or start with --rejoin to follow {replica_of}, which must be at a "
            "newer epoch)")
