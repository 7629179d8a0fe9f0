"""Small file-system helpers: atomic metadata writes and directory fsync."""

from __future__ import annotations

import errno
import json
import os
import threading

import google_crc32c

from chronoq.core import errors


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync a file by path (any thread). A file deleted meanwhile needs no sync: skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error(exc, path) from exc
    finally:
        os.close(fd)


_rewrites = 0  # files replaced by ``atomic_write`` in this process (``rewrites``)
# Writers of one path take turns (a path hashes to one of these locks): two threads writing the
# same file at once (an admin call's offsets.json and a checkpoint job's) shared its temp file,
# one truncating it under the other; the second rename failed (FileNotFoundError) and the first
# could rename a torn file into place. Striped: bounded, whatever the number of paths.
_WRITE_LOCKS = tuple(threading.Lock() for _ in range(64))


def rewrites() -> int:
    """How many files ``atomic_write`` replaced so far in this process: a reader that polls
    files rewritten whole (chronoq.replication.shipper, the snapshot files) looks at them again
    only when this moved (or now and then, for a writer of its own)."""
    return _rewrites


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a crash leaves either the old or the new file whole.

    Temp file in the same directory, fsync, rename over the target, fsync the directory.
    """
    global _rewrites
    tmp = f"{path}.tmp"
    with _WRITE_LOCKS[hash(path) % len(_WRITE_LOCKS)]:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            _unlink_quiet(tmp)
            raise storage_error(exc, path) from exc
        os.close(fd)
        os.replace(tmp, path)
        _rewrites += 1
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def storage_error(exc: OSError, path: str) -> errors.StorageError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.DiskFull(f"disk full while writing {path}; free space and retry")
    return errors.StorageError(f"I/O error on {path}: {exc.strerror or exc}")


# JSON documents with a checksum line, so a torn or edited file is detected rather than misread.
# Format: first line "chronoq-json v1 crc32c=<hex>", then the UTF-8 JSON body.
_JSON_MAGIC = "chronoq-json v1 crc32c="


def write_json(path: str, obj: object) -> None:
    write_json_body(path, dumps_json(obj))


def dumps_json(obj: object) -> bytes:
    """The body ``write_json`` writes for ``obj``: keys sorted, no spaces (a writer that keeps
    parts of a document encoded joins what this gives for each part)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_json_body(path: str, body: bytes) -> None:
    """``write_json`` of a body already encoded (``dumps_json``)."""
    header = f"{_JSON_MAGIC}{google_crc32c.value(body):08x}\n".encode()
    atomic_write(path, header + body)


def read_json(path: str) -> object | None:
    """Return the document, ``None`` if the file does not exist; raise ValueError if damaged."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None
    header, sep, body = raw.partition(b"\n")
    text = header.decode("ascii", "replace")
    if not sep or not text.startswith(_JSON_MAGIC):
        raise ValueError(f"{path}: missing checksum header")
    try:
        expected = int(text[len(_JSON_MAGIC):], 16)
    except ValueError:
        raise ValueError(f"{path}: unreadable checksum header") from None
    if google_crc32c.value(body) != expected:
        raise ValueError(f"{path}: checksum mismatch (truncated or edited)")
    return json.loads(body)


def read_source(path: str, advice: str) -> dict:
    """A source file's document (``read_json``), ``{}`` when it does not exist. A damaged one
    (bad checksum, or not a JSON object) refuses the open: ``CorruptionError`` naming the file,
    with the owner's ``advice`` (what the file holds, what the operator can do): a source cannot
    be rebuilt exactly, so nothing is guessed without them."""
    try:
        data = read_json(path)
    except ValueError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
    else:
        if data is None or isinstance(data, dict):
            return data or {}
        reason = f"a JSON {type(data).__name__}, not an object"
    raise errors.CorruptionError(path, 0, reason, advice)


def read_state(path: str, log, what: str, fallback: str) -> dict:
    """A state file's document, ``{}`` when it does not exist or is damaged. A damaged one is
    logged as a warning naming ``what`` it held and the ``fallback`` its owner takes (a replay
    from the log's start, or the last durable state held elsewhere)."""
    try:
        return read_json(path) or {}
    except ValueError as exc:
        log.warning("%s unreadable (%s); %s", what, exc, fallback)
        return {}
