"""Message ids in the RocketMQ 5 format the official clients generate.

34 uppercase hex characters: ``01`` (version), 12 hex MAC address, 4 hex low 16 bits of the pid,
8 hex seconds since 2021-01-01T00:00:00Z (mod 2**32), 8 hex per-process counter.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid

EPOCH_2021_S = 1_609_459_200
_lock = threading.Lock()
_counter = itertools.count()


def _prefix() -> str:
    mac = uuid.getnode() & 0xFFFFFFFFFFFF
    return f"01{mac:012X}{os.getpid() & 0xFFFF:04X}"


_PREFIX = _prefix()
_PREFIX_PID = os.getpid()


def new_message_id(now_ms: int) -> str:
    global _PREFIX, _PREFIX_PID
    if os.getpid() != _PREFIX_PID:  # forked: the pid field must change
        _PREFIX, _PREFIX_PID = _prefix(), os.getpid()
    with _lock:
        seq = next(_counter) & 0xFFFFFFFF
    secs = (now_ms // 1000 - EPOCH_2021_S) & 0xFFFFFFFF
    return f"{_PREFIX}{secs:08X}{seq:08X}"


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
        "pid": int(message_id[14:18], 16),
        "seconds_since_2021": int(message_id[18:26], 16),
        "sequence": int(message_id[26:34], 16),
    }
