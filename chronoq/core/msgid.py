"""Message ids in the RocketMQ 5 format the official clients generate.

34 uppercase hex characters: ``01`` (version), 12 hex MAC address, 4 hex process field, 8 hex
seconds since 2021-01-01T00:00:00Z (mod 2**32), 8 hex per-process counter.

The process field is the low 16 bits of the pid with the top bit flipped. The official clients use
the pid as it is, with a counter from 0 as ours: an application that sends with both
``chronoq.client`` and the official client in one process would otherwise mint the same ids in the
same second, and the broker's dedupe window would drop one message as a resend of the other.
"""

from __future__ import annotations

import itertools
import os
import uuid

EPOCH_2021_S = 1_609_459_200
_counter = itertools.count()


def _prefix() -> str:
    mac = uuid.getnode() & 0xFFFFFFFFFFFF
    return f"01{mac:012X}{(os.getpid() & 0xFFFF) ^ 0x8000:04X}"


_PREFIX = _prefix()
_head_second = -1
_head = ""


def _after_fork() -> None:
    # A forked child has a new pid, so its ids need a new prefix (and the cached head with it).
    global _PREFIX, _head_second
    _PREFIX, _head_second = _prefix(), -1


os.register_at_fork(after_in_child=_after_fork)


def new_message_id(now_ms: int) -> str:
    global _head_second, _head
    second = now_ms // 1000
    if second != _head_second:  # the first 26 characters change once a second
        _head = f"{_PREFIX}{(second - EPOCH_2021_S) & 0xFFFFFFFF:08X}"
        _head_second = second
    # next() on itertools.count is atomic under the GIL: no lock needed for unique sequences.
    return f"{_head}{next(_counter) & 0xFFFFFFFF:08X}"


def new_message_ids(now_ms: int, n: int) -> list[bytes]:
    """``n`` ids for messages created at ``now_ms``, ASCII-encoded: ``new_message_id`` in bulk
    (a staged chunk of thousands of rows shares one head; no call per id)."""
    head = new_message_id(now_ms)[:-8].encode()
    return [head + b"%08X" % (c & 0xFFFFFFFF) for c in itertools.islice(_counter, n)]


def parse_message_id(message_id: str) -> dict | None:
    """Fields of a v1 id, or None when the id is not in that format (other ids are accepted too)."""
    if len(message_id) != 34 or not message_id.startswith("01"):
        return None
    try:
        int(message_id, 16)
    except ValueError:
        return None
    return {
        "mac": message_id[2:14],
        "process": int(message_id[14:18], 16),  # the official clients' pid & 0xFFFF; ours flips bit 15
        "seconds_since_2021": int(message_id[18:26], 16),
        "sequence": int(message_id[26:34], 16),
    }
