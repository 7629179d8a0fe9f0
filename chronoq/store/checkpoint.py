"""The store's checkpoint: how far the consume queues are complete, for recovery to start there.

File ``checkpoint.json`` in the data directory (``fsutil.write_json``)::

    {"version": 1, "dispatched": <log offset>, "log_end": <log offset>, "clean": <bool>,
     "queues": {"<topic>/<queue id>": <next logical offset>, ...},
     "queue_mins": {"<topic>/<queue id>": <first logical offset>, ...},
     "written_at_ms": <wall ms>}

``queue_mins`` may be absent (older checkpoints); then a queue's start is not checked. Under the
async policy ``dispatched`` may be ahead of the fsynced log: the document then claims only what
is synced and leaves ``queues`` (and ``queue_mins``) empty.

Every consume-queue file is fsynced before a checkpoint naming its entries is written, so after
a crash the queues hold at least what the checkpoint says, and replay from ``dispatched`` is
positional and idempotent.
"""

from __future__ import annotations

import os

from chronoq.core import fsutil
from chronoq.core.jobs import Job
from chronoq.store.consumequeue import ConsumeQueue
from chronoq.store.recovery import RecoveryReport

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1


def read(data_dir: str, has_log: bool, report: RecoveryReport) -> dict | None:
    """The checkpoint document, or None (no file, unreadable, unknown version: noted in
    ``report``; ``has_log`` says whether the log has segments, which makes a missing file news)."""
    path = os.path.join(data_dir, CHECKPOINT_FILE)
    try:
        cp = fsutil.read_json(path)
    except ValueError as exc:  # R7
        report.notes.append(f"checkpoint unreadable ({exc}); rebuilding queues from the log")
        return None
    if cp is not None and (not isinstance(cp, dict) or cp.get("version") != CHECKPOINT_VERSION):
        report.notes.append("checkpoint has an unknown version; rebuilding queues from the log")
        return None
    if cp is None and has_log:
        report.notes.append("no checkpoint; rebuilding queues from the log")
    return cp


def document(dispatched: int, synced: int, log_end: int, queues: dict[tuple[str, int], ConsumeQueue],
             clean: bool, now_ms: int) -> dict:
    """The document for a checkpoint taken now: ``dispatched``, ``synced`` and ``log_end`` are
    the store's log offsets, ``queues`` its consume queues."""
    claimed = min(dispatched, synced)
    if claimed < dispatched:
        # Async policy: queues may be ahead of the durable log. Only claim what is synced,
        # with the queue sizes as of ``dispatched`` unknown, so record the lower safe bound.
        ends = {}
    else:
        ends = {f"{t}/{q}": cq.next_offset for (t, q), cq in queues.items()}
    # Queue starts too, so a lost first consume-queue file is detected (row R8).
    queue_mins = {f"{t}/{q}": cq.min_offset for (t, q), cq in queues.items()} if ends else {}
    return {
        "version": CHECKPOINT_VERSION, "dispatched": claimed, "log_end": log_end,
        "clean": clean, "queues": ends, "queue_mins": queue_mins, "written_at_ms": now_ms,
    }


def write(data_dir: str, doc: dict) -> None:
    fsutil.write_json(os.path.join(data_dir, CHECKPOINT_FILE), doc)


def job(data_dir: str, queues: dict[tuple[str, int], ConsumeQueue], make_doc) -> Job:
    """A checkpoint without blocking the writer's thread (see ``chronoq.core.jobs``).

    Here: take the consume-queue files written since the last checkpoint and the document
    (``make_doc()``) to write, as of now. ``run`` (any thread): fsync those files by path, then
    write the document. Every entry the document claims was written before ``run`` starts, so
    the fsync covers it; entries written meanwhile may be synced along, which is harmless.
    ``finish`` with an error marks the files dirty again for the next checkpoint.
    """
    taken = [(cq, cq.take_dirty()) for cq in queues.values()]
    paths = [path for _cq, files in taken for _index, path in files]
    doc = make_doc()
    target = os.path.join(data_dir, CHECKPOINT_FILE)

    def run() -> None:
        for path in paths:
            fsutil.fsync_path(path)
        fsutil.write_json(target, doc)

    def finish(exc: BaseException | None) -> None:
        if exc is not None:
            for cq, files in taken:
                cq.mark_dirty(index for index, _path in files)

    return Job("store checkpoint", run, finish)
