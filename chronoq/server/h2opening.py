"""An HTTP/2 connection's opening and its clock, for ``chronoq.server.h2server.Connection``.

What happens once per connection, or once per timeout, never per frame or call: the broker-wide
connection cap (a connection over it gets an empty SETTINGS and a GOAWAY naming the limit, then
is closed), the peer's name as gRPC spells it, our first SETTINGS and window update, the
deadline for the client's preface and first SETTINGS, then one idle check per
``h2_idle_timeout_ms`` (one timer handle per connection at a time: ``conn._timer``).

Plain Python on purpose: ``h2server`` is compiled for its per-frame path, and nothing here is on
it (the compiled ``Connection``'s fields these functions use are ``public`` in its ``.pxd``).
"""

from __future__ import annotations

from chronoq.core import refusals as R
from chronoq.protocol.h2 import (ENHANCE_YOUR_CALM, NO_ERROR, PROTOCOL_ERROR, S_ENABLE_PUSH,
                                 S_INITIAL_WINDOW_SIZE, S_MAX_CONCURRENT_STREAMS, S_MAX_FRAME_SIZE,
                                 S_MAX_HEADER_LIST_SIZE, goaway_frame, settings_frame)

OUR_STREAM_WINDOW = 4 << 20       # what each stream may send us before we grant more
OUR_CONN_WINDOW = 16 << 20        # and the whole connection
OUR_MAX_FRAME = 1 << 20           # clients may send DATA frames this big (fewer frames per big send)


def peer_name(peer) -> str:
    """gRPC's name for the peer address ``transport.get_extra_info("peername")`` gives."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = peer[0]
        return f"ipv6:[{host}]:{peer[1]}" if ":" in host else f"ipv4:{host}:{peer[1]}"
    return "unix:" + str(peer or "")


def open_connection(conn, transport) -> None:
    """``Connection.connection_made``'s work once the transport is set: turn the connection away
    if the server is at its cap, else send our SETTINGS and start the preface deadline."""
    conn.peer = peer_name(transport.get_extra_info("peername"))
    limits = conn.limits
    if len(conn.server._connections) >= limits.max_connections:
        # Over the broker-wide cap: this connection alone is turned away, at once.
        conn.refuse(R.CONNECTIONS, f"{limits.max_connections} connections open")
        transport.write(settings_frame(()) + goaway_frame(
            0, ENHANCE_YOUR_CALM, f"connection limit {limits.max_connections} (h2_max_connections)"))
        transport.close()
        conn.closed = True
        return
    transport.write(settings_frame((
        (S_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams), (S_INITIAL_WINDOW_SIZE, OUR_STREAM_WINDOW),
        (S_MAX_FRAME_SIZE, OUR_MAX_FRAME), (S_MAX_HEADER_LIST_SIZE, limits.max_header_list),
        (S_ENABLE_PUSH, 0))) + conn.opening_update())
    conn.server._connections.add(conn)
    conn._timer = conn.loop.call_later(limits.preface_timeout_s, preface_expired, conn)


def settings_seen(conn) -> None:
    """The client's first SETTINGS came: the preface is complete, from now on only idleness is timed."""
    conn.settings_seen = True
    if conn._timer is not None:
        conn._timer.cancel()
    conn._timer = conn.loop.call_later(conn.limits.idle_timeout_s, idle_check, conn)


def preface_expired(conn) -> None:
    conn._timer = None
    if not conn.settings_seen and not conn.closed:
        seconds = conn.limits.preface_timeout_s
        conn.refuse(R.PREFACE_TIMEOUT, f"no preface and SETTINGS in {seconds:g} s")
        conn._fail(PROTOCOL_ERROR, f"no HTTP/2 preface and SETTINGS within {seconds:g} s (h2_preface_timeout_ms)")


def idle_check(conn) -> None:
    """Once per idle timeout: close the connection if it had no stream since the last check."""
    conn._timer = None
    if conn.closed:
        return
    if conn._idle.check(len(conn.streams), conn.last_stream):
        seconds = conn.limits.idle_timeout_s
        conn.refuse(R.IDLE_TIMEOUT, f"no call for {seconds:g} s")
        conn._fail(NO_ERROR, f"idle for {seconds:g} s (h2_idle_timeout_ms)")  # clients reconnect
    else:
        conn._timer = conn.loop.call_later(conn.limits.idle_timeout_s, idle_check, conn)
