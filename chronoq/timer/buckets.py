"""In-memory state of one schedule bucket. Pure: bytes in, state and wheel changes out.

A bucket is UNLOADED (far future: only a write buffer of entries not yet in its file, often
empty, and no per-message memory at all), LOADING (its entries are being parsed, a bounded number
per tick, so loading a large bucket never stalls deliveries) or LOADED (in the near window: every
pending message is in the timing wheel).

While LOADING nothing of the bucket is in the wheel: a tombstone later in the file may retire a
message met earlier, so a message only becomes eligible once the whole bucket has been read.
"""

from __future__ import annotations

from chronoq.timer import schedlog
from chronoq.timer.schedlog import CANCELLED, DISPATCHED, ENTRY_HEAD_SIZE, MESSAGE, MOVED, Damage

UNLOADED = 0
LOADING = 1
LOADED = 2
STATE_NAMES = {UNLOADED: "unloaded", LOADING: "loading", LOADED: "loaded"}


class WriteBuffer:
    """A bucket's entries not yet in its file, as the chunks they were appended in (an absorbed
    batch's entries for this bucket, a tombstone): never copied into one buffer, written to the
    file as they are (``schedfiles.ScheduleFiles.write``: one ``writev``). A bulk delayed publish
    appends ~1 KB per message here, and growing one bytearray copied every byte twice more (its
    growth and the ``bytes()`` for the write) and faulted in fresh pages each cycle.

    ``len`` is the byte count; ``bytes(buffer)`` the entries as one string (the readers that scan
    a bucket's unwritten entries; it keeps that string as the one chunk)."""

    __slots__ = ("chunks", "size")

    def __init__(self):
        self.chunks: list[bytes] = []
        self.size = 0

    def append(self, chunk: bytes) -> None:
        assert type(chunk) is bytes, "a chunk is kept, not copied: it must not change"
        self.chunks.append(chunk)
        self.size += len(chunk)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        chunks = self.chunks
        if len(chunks) > 1:
            chunks[:] = [b"".join(chunks)]
        return chunks[0] if chunks else b""


class Bucket:
    __slots__ = ("start", "buffer", "data", "parse_pos", "pending", "claimed", "resolved", "state",
                 "path", "message_entries")

    def __init__(self, start: int, path: str):
        self.start = start
        self.path = path
        self.buffer = WriteBuffer()  # entries not yet written to the file (a suffix of the file-to-be)
        self.data: bytearray | None = None  # LOADING/LOADED: every entry, file order, no file header
        self.parse_pos = 0
        self.pending: dict[int, tuple[int, int, int]] = {}  # ident -> (due_ms, pos in data, entry length)
        self.claimed: set[int] = set()  # handed to the timer lane, copy not yet durable
        # ident -> (kind, due_ms, aux) for CANCELLED/MOVED, and DISPATCHED while LOADING only (once
        # loaded, no duplicate MESSAGE can arrive, so delivered idents need no memory).
        self.resolved: dict[int, tuple[int, int, int]] = {}
        self.state = UNLOADED
        self.message_entries = 0

    # ----------------------------------------------------------------- building
    def append(self, entry: bytes) -> None:
        """Add an entry (file order): to the write buffer, and to ``data`` when loading/loaded."""
        self.buffer.append(entry)
        if self.data is not None:
            self.data += entry

    def append_dispatched(self, blob: bytes, idents: list[int]) -> bool:
        """Fast path for a LOADED, fully parsed bucket: add DISPATCHED entries for claimed idents
        without parsing them back. Returns False (nothing done) when the bucket is not in that
        state; the caller then appends them one by one."""
        if self.state != LOADED or not self.parsed or not self.claimed.issuperset(idents):
            return False
        assert self.data is not None
        self.buffer.append(blob)
        self.data += blob
        self.parse_pos = len(self.data)
        self.claimed.difference_update(idents)
        return True

    def begin_load(self, file_entries: bytes) -> None:
        """Start loading from the file's entries (without header); unflushed entries follow them."""
        assert self.state == UNLOADED and self.data is None
        # A bytearray (``bucketreader.BucketReader``) is taken over, not copied: it can be ~70 MB.
        self.data = file_entries if type(file_entries) is bytearray else bytearray(file_entries)
        for chunk in self.buffer.chunks:
            self.data += chunk
        self.parse_pos = 0
        self.state = LOADING

    def load_empty(self) -> None:
        """A bucket created inside the loaded window: no file to read."""
        assert self.state == UNLOADED and not self.buffer
        self.data = bytearray()
        self.state = LOADED

    @property
    def parsed(self) -> bool:
        return self.data is not None and self.parse_pos >= len(self.data)

    def parse(self, limit: int, damage: list[Damage]) -> tuple[list, list, int]:
        """Apply up to ``limit`` unparsed entries. Returns (became pending, left pending, count).

        Both lists hold ``(ident, due_ms)``: the caller adds/removes them in the wheel when the
        bucket is LOADED (while LOADING, only ``finish_load`` puts entries in the wheel).
        """
        data = self.data
        assert data is not None
        added: list[tuple[int, int]] = []
        removed: list[tuple[int, int]] = []
        pos, end, n = self.parse_pos, len(data), 0
        check, fields = schedlog.check_entry, schedlog.entry_fields
        pending, resolved, claimed = self.pending, self.resolved, self.claimed
        loaded = self.state == LOADED
        while pos < end and n < limit:
            try:
                total = check(data, pos, end)
            except schedlog.SchedLogError as exc:  # S4: data from the file whose tail was checked
                nxt = schedlog.find_next_valid(data, pos + 1, end)
                stop = end if nxt is None else nxt
                damage.append(Damage(self.path, pos, stop, exc.reason, False))
                pos = stop
                continue
            _t, kind, ident, due_ms, aux = fields(data, pos)
            if kind == MESSAGE:
                self.message_entries += 1
                if ident not in pending and ident not in resolved and ident not in claimed:
                    pending[ident] = (due_ms, pos, total)
                    added.append((ident, due_ms))
            else:
                was = pending.pop(ident, None)
                if was is not None:
                    removed.append((ident, was[0]))
                claimed.discard(ident)
                if kind != DISPATCHED or not loaded:
                    resolved[ident] = (kind, due_ms, aux)
            pos += total
            n += 1
        self.parse_pos = pos
        return added, removed, n

    def finish_load(self) -> list[tuple[int, int]]:
        """LOADING -> LOADED once everything is parsed; returns the pending entries for the wheel."""
        assert self.state == LOADING and self.parsed
        self.state = LOADED
        for ident in [i for i, r in self.resolved.items() if r[0] == DISPATCHED]:
            del self.resolved[ident]
        return [(ident, p[0]) for ident, p in self.pending.items()]

    # ----------------------------------------------------------------- delivering
    def claim(self, ident: int) -> bytes:
        """Take a pending entry for delivery; returns its commit-log record bytes."""
        due_ms, pos, total = self.pending.pop(ident)
        self.claimed.add(ident)
        assert self.data is not None
        # Two small copies, but no memoryview to make and release per claim: half the cost (and
        # no exported view can block the bytearray from growing).
        return bytes(self.data[pos + ENTRY_HEAD_SIZE:pos + total])

    def record_of(self, ident: int) -> bytes | None:
        hit = self.pending.get(ident)
        if hit is None or self.data is None:
            return None
        _due, pos, total = hit
        return bytes(self.data[pos + ENTRY_HEAD_SIZE:pos + total])

    def state_of(self, ident: int) -> int | None:
        """MESSAGE (pending or being delivered), a resolved kind, or None (unknown here)."""
        if ident in self.pending or ident in self.claimed:
            return MESSAGE
        hit = self.resolved.get(ident)
        return None if hit is None else hit[0]

    def finishable(self, now_ms: int, width_ms: int) -> bool:
        """Everything delivered or retired, and no new entry can be routed here any more."""
        return (self.state == LOADED and self.parsed and not self.pending and not self.claimed
                and now_ms >= self.start + width_ms)

    def done_entries(self) -> bytes:
        """What a ``.done`` file keeps: the CANCELLED/MOVED entries."""
        return b"".join(schedlog.encode_entry(kind, ident, due_ms, aux)
                        for ident, (kind, due_ms, aux) in sorted(self.resolved.items())
                        if kind in (CANCELLED, MOVED))

    def counts(self) -> dict:
        return {"pending": len(self.pending), "in_flight": len(self.claimed),
                "retired": sum(1 for r in self.resolved.values() if r[0] != DISPATCHED)}


def lookup(path: str, start: int, file_data: bytes, extra: bytes, ident: int) -> tuple[int | None, bytes | None]:
    """State of ``ident`` in an unloaded bucket (file bytes plus unflushed entries), and its record.

    Returns (MESSAGE/DISPATCHED/CANCELLED/MOVED or None, the record bytes when pending).
    """
    state: int | None = None
    raw: bytes | None = None
    hits: list[tuple[bytes, int, int, int]] = []
    if file_data:
        try:
            hits.extend((file_data, pos, total, kind)
                        for pos, total, kind, i, _d, _a in schedlog.scan(path, start, file_data) if i == ident)
        except schedlog.SchedLogError:  # a bad file header: nothing in the file can be trusted
            pass
    hits.extend((extra, pos, total, kind) for pos, total, kind in _iter_plain(extra, ident))
    for data, pos, total, kind in hits:
        if kind != MESSAGE:
            state = kind
        elif state is None:
            state = MESSAGE
            raw = bytes(data[pos + ENTRY_HEAD_SIZE:pos + total])
    return state, (raw if state == MESSAGE else None)


def _iter_plain(data: bytes, ident: int):
    pos = 0
    while pos < len(data):
        total, kind, i, _due, _aux = schedlog.entry_fields(data, pos)
        if i == ident:
            yield pos, total, kind
        pos += total


def count_pending(path: str, start: int, file_data: bytes, extra: bytes) -> tuple[int, int]:
    """(pending messages, highest ident any entry names) of an unloaded bucket, for the "due in
    the next N minutes" stats; the second lets ``Horizon`` count later entries on their own."""
    pairs = []
    if file_data:
        try:
            pairs.extend((k, i) for _p, _t, k, i, _d, _a in schedlog.scan(path, start, file_data))
        except schedlog.SchedLogError:
            pass
    pos = 0
    while pos < len(extra):
        total, kind, ident, _due, _aux = schedlog.entry_fields(extra, pos)
        pairs.append((kind, ident))
        pos += total
    top = max((i for _k, i in pairs), default=-1)
    return sum(1 for kind in schedlog.summarize(pairs).values() if kind == MESSAGE), top
