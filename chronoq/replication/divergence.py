"""Where a rejoining node's log leaves its primary's: the epoch arithmetic. Pure: no I/O.

Epoch history. Every promotion appends an epoch record (``position.epoch_record``); epoch ``n``
*starts* at the global commit-log offset of its record (its first byte), and runs until the
start of epoch ``n + 1`` on the node that holds the next record. Epoch 0 (the first primary's)
starts at offset 0 and has no record. A node's history is ``[(epoch, start), ...]`` ascending,
read from its ``CHRONOQ_EPOCH`` queue (``position.epoch_history``), with ``(0, 0)`` first.

A replica at its newest epoch ``e`` (started at ``s``) with its log ending at ``end`` asks a
primary whose history is ``H`` (``decide``):

| case | the answer |
|------|------------|
| ``e`` greater than the primary's newest epoch | refused: the replica is newer (it was promoted after this primary's last term; point it elsewhere or serve it as the primary) |
| ``e`` not in ``H``, or in ``H`` at a start other than ``s`` | refused: a history the epochs do not explain (another cluster, or two promotions to the same epoch) |
| ``e`` is the primary's newest epoch | ``None``: no epoch boundary lies after the replica's; the prefix check decides as before (a replica past the primary's durable end is refused) |
| the first epoch after ``e`` in ``H`` starts at ``S >= end`` | ``None``: the replica ends before the boundary; the prefix check decides |
| it starts at ``S = 0 < end`` (the primary's first epoch began on an empty log) | ``None``: the replica's bytes are that epoch's own first records (copied before its history caught up) or none of the primary's; the prefix check decides, never a cut |
| it starts at ``0 < S < end`` | ``Cut(S, epoch)``: the replica's bytes ``[S, end)`` were written by the old primary in its term after the new one began: the replica truncates at ``S`` (after checking its bytes before ``S`` are the primary's) and follows from there |

The bytes before ``S`` are checked by the replica (a CRC-32C of up to 4 KiB before ``S``, sent by
the primary) before anything is cut, so two logs that share epoch numbers and offsets but not
their bytes (another cluster) are still refused, with nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    offset: int  # the divergence point: truncate the replica's log here
    epoch: int   # the primary's epoch that starts there


class Unexplained(Exception):
    """A divergence the epochs do not explain: refuse, change nothing."""


def decide(history: list[tuple[int, int]], epoch: int, epoch_start: int, end: int) -> Cut | None:
    """What a replica at ``epoch`` (started at ``epoch_start``) ending at ``end`` must do before it
    follows a primary with ``history`` (see the table above). Raises ``Unexplained``."""
    assert history and history[0] == (0, 0), history
    assert all(a[0] < b[0] and (a[1] < b[1] or a == (0, 0)) for a, b in zip(history, history[1:])), history
    newest = history[-1][0]
    if epoch > newest:
        raise Unexplained(
            f"the replica is at epoch {epoch}, newer than this primary's {newest}: it was promoted after this "
            "node's term; refusing to ship (serve it as the primary, or point it at the newest one)")
    starts = dict(history)
    if epoch not in starts:
        raise Unexplained(
            f"the replica's epoch {epoch} (started at {epoch_start}) is not in this primary's history "
            f"{_show(history)}: another cluster, or a history that diverged; refusing to ship")
    if starts[epoch] != epoch_start:
        raise Unexplained(
            f"the replica's epoch {epoch} started at {epoch_start}, this primary's at {starts[epoch]}: two "
            "different terms with the same number (another cluster, or a history that diverged); refusing to ship")
    later = [(e, s) for e, s in history if e > epoch]
    if not later:
        return None
    nxt_epoch, boundary = later[0]
    if boundary >= end:
        return None
    if boundary == 0:
        # The primary's first epoch began on an empty log: bytes of epoch 0 here are either its own
        # first records, copied before this replica's epoch history caught up with them (a prefix),
        # or no part of its history at all (a node that served alone): the prefix check tells
        # which, and refuses the second. Never a cut: it would throw away a whole log.
        return None
    return Cut(boundary, nxt_epoch)


def _show(history: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"{e}@{s}" for e, s in history[-6:])
    return ("... " if len(history) > 6 else "") + shown
