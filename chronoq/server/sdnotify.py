"""systemd's readiness protocol (``sd_notify``): tell the service manager when the broker is ready.

Under a unit with ``Type=notify`` (``deploy/chronoq.service``) systemd sets ``NOTIFY_SOCKET`` to a
Unix datagram socket and waits for ``READY=1`` before it counts the service as started, so units
ordered after chronoq start only once recovery is over and the ports listen. ``STOPPING=1`` says a
clean stop began; ``STATUS=`` is the line ``systemctl status`` shows. Without ``NOTIFY_SOCKET``
(not under systemd) every call does nothing. The protocol is a few bytes on a socket, so it is
spoken here rather than through a dependency.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("chronoq.sdnotify")


def notify(*fields: str) -> bool:
    """Send ``fields`` (``"READY=1"``, ``"STATUS=..."``) to the service manager; True if sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":  # an abstract socket: its name begins with a NUL byte
        address = "\0" + address[1:]
    elif address[0] != "/":
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket; not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as exc:  # the manager went away: the broker serves on regardless
        log.warning("could not notify the service manager at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True
