"""chronoq.protocol.h2's sans-IO pieces against libraries that are not ours: frames against
``hyperframe``, HPACK encoding against ``hpack``, gRPC's message framing against zlib and gRPC's
own rules. No sockets, no event loop."""

import ast
import gzip
import pathlib
import zlib
from urllib.parse import unquote

import hpack
import pytest
from hpack.hpack import encode_integer as reference_integer
from hyperframe.frame import (DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame,
                              WindowUpdateFrame)
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.protocol import h2

stream_ids = st.integers(min_value=1, max_value=(1 << 31) - 1)
payloads = st.binary(max_size=300)
pads = st.integers(min_value=0, max_value=255)


def _parse(data: bytes) -> Frame:
    """One whole frame, read by hyperframe."""
    frame, length = Frame.parse_frame_header(memoryview(data[:9]))
    assert length == len(data) - 9
    frame.parse_body(memoryview(data[9:]))
    return frame


def _as_ours(theirs: Frame) -> tuple[int, int, int, bytes]:
    """A hyperframe frame as read_frames hands it over: (type, flags, stream id, payload)."""
    data = theirs.serialize()
    return data[3], data[4], theirs.stream_id, data[9:]


# ----------------------------------------------------------------------------- frames to bytes
@settings(max_examples=200, deadline=None)
@given(stream_ids, payloads, st.booleans())
def test_data_and_headers_frames_read_back_in_hyperframe(sid, payload, end):
    data = _parse(h2.frame(h2.DATA, h2.END_STREAM if end else 0, sid, payload))
    assert isinstance(data, DataFrame) and data.stream_id == sid and data.data == payload
    assert ("END_STREAM" in data.flags) == end
    headers = _parse(h2.headers_frame(sid, payload, end))
    assert isinstance(headers, HeadersFrame) and headers.data == payload and "END_HEADERS" in headers.flags
    assert ("END_STREAM" in headers.flags) == end


@settings(max_examples=100, deadline=None)
@given(stream_ids, st.integers(min_value=0, max_value=(1 << 31) - 1), st.integers(min_value=0, max_value=0xFF),
       st.text(max_size=300))
def test_control_frames_read_back_in_hyperframe(sid, number, code, debug):
    assert _parse(h2.window_update_frame(sid, max(number, 1))).window_increment == max(number, 1)
    assert _parse(h2.rst_stream_frame(sid, code)).error_code == code
    goaway = _parse(h2.goaway_frame(number, code, debug))
    assert isinstance(goaway, GoAwayFrame) and (goaway.last_stream_id, goaway.error_code) == (number, code)
    assert goaway.additional_data == debug.encode("utf-8", "replace")[:h2.GOAWAY_DEBUG_MAX]


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from([1, 2, 3, 4, 5, 6, 0x99]), st.integers(min_value=0, max_value=1),
                       max_size=7))
def test_settings_frames_read_back_in_hyperframe(entries):
    theirs = _parse(h2.settings_frame(entries.items()))
    assert isinstance(theirs, SettingsFrame) and dict(theirs.settings) == entries
    assert "ACK" in _parse(h2.SETTINGS_ACK).flags


@settings(max_examples=200, deadline=None)
@given(stream_ids, st.binary(max_size=2000), st.integers(min_value=-5, max_value=3000),
       st.integers(min_value=1, max_value=700), st.booleans())
def test_data_frames_take_what_the_window_allows(sid, data, room, max_frame, end):
    frames, taken = h2.data_frames(sid, data, room, max_frame, h2.END_STREAM if end else 0)
    assert taken == max(0, min(len(data), room))
    parsed = [_parse(f) for f in frames]
    assert all(isinstance(f, DataFrame) and f.stream_id == sid and 0 < len(f.data) <= max_frame for f in parsed)
    assert b"".join(f.data for f in parsed) == data[:taken]
    ends = ["END_STREAM" in f.flags for f in parsed]
    assert ends == [end and i == len(parsed) - 1 and taken == len(data) for i in range(len(parsed))]


# ----------------------------------------------------------------------------- bytes to frames
def _theirs(kind: str, sid: int, payload: bytes, pad: int, end: bool) -> Frame:
    flags = ["END_STREAM"] if end else []
    if kind == "data":
        return DataFrame(sid, data=payload, pad_length=pad, flags=flags + (["PADDED"] if pad else []))
    if kind == "headers":
        return HeadersFrame(sid, data=payload, pad_length=pad, depends_on=sid // 2, stream_weight=pad,
                            flags=flags + ["END_HEADERS", "PRIORITY"] + (["PADDED"] if pad else []))
    if kind == "ping":
        return PingFrame(0, opaque_data=payload[:8].ljust(8, b"\0"))
    if kind == "rst":
        return RstStreamFrame(sid, error_code=pad)
    if kind == "window":
        return WindowUpdateFrame(sid, window_increment=pad + 1)
    if kind == "settings":
        return SettingsFrame(0, settings={h2.S_INITIAL_WINDOW_SIZE: pad, h2.S_MAX_FRAME_SIZE: 16_384 + pad})
    return GoAwayFrame(0, last_stream_id=sid, error_code=pad, additional_data=payload)


frame_specs = st.lists(st.tuples(st.sampled_from(["data", "headers", "ping", "rst", "window", "settings", "goaway"]),
                                 stream_ids, payloads, pads, st.booleans()), max_size=12)


@settings(max_examples=200, deadline=None)
@given(frame_specs, st.lists(st.integers(min_value=0, max_value=4000), max_size=6))
def test_read_frames_reads_hyperframe_frames_however_the_bytes_arrive(specs, cuts):
    theirs = [_theirs(*spec) for spec in specs]
    wire = b"".join(f.serialize() for f in theirs)
    buf, got = bytearray(), []
    for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(wire)]):
        buf += wire[start:end]  # (cuts past the end, or out of order, add nothing)
        used, too_long = h2.read_frames(buf, h2.MAX_FRAME_LENGTH, _collect(got))
        assert too_long == 0
        del buf[:used]
    assert not buf
    assert got == [_as_ours(f) for f in theirs]
    assert all(type(payload) is bytes for *_, payload in got)  # (cut from the bytearray: bytes all the same)
    for (kind, flags, sid, payload), frame in zip(got, theirs):  # the payload pieces, as hyperframe reads them
        if kind == h2.DATA:
            assert (h2.unpad(payload) if flags & h2.PADDED else payload) == frame.data
        elif kind == h2.HEADERS:
            assert flags & h2.HEADERS_EXTRAS and h2.header_fragment(flags, payload) == frame.data
        elif kind == h2.WINDOW_UPDATE:
            assert h2.window_increment(payload) == frame.window_increment
        elif kind == h2.SETTINGS:
            assert dict(h2.parse_settings(payload)) == dict(frame.settings)
        elif kind == h2.GOAWAY:
            assert h2.parse_goaway(payload) == (frame.last_stream_id, frame.error_code, frame.additional_data)


def _collect(into: list, stop_after: int = -1):
    """A read_frames handler that keeps the frames (and says stop after ``stop_after`` of them)."""
    def handle(*frame):
        into.append(frame)
        return len(into) == stop_after
    return handle


def test_a_frame_over_the_limit_is_refused_on_its_header_after_the_frames_before_it():
    first = PingFrame(0, opaque_data=b"12345678").serialize()
    big = DataFrame(1, data=b"x" * 100).serialize()
    got = []
    used, too_long = h2.read_frames(first + big[:20], 99, _collect(got))  # its bytes need not have come
    assert got == [_as_ours(PingFrame(0, opaque_data=b"12345678"))] and used == len(first) and too_long == 100
    got = []
    assert h2.read_frames(big, 100, _collect(got)) == (len(big), 0)  # at the limit
    assert got == [_as_ours(DataFrame(1, data=b"x" * 100))]


def test_reading_stops_when_the_handler_says_the_connection_ended():
    wire = b"".join(h2.frame(h2.PING, 0, 0, bytes([i]) * 8) for i in range(3))
    got = []
    assert h2.read_frames(wire, 100, _collect(got, stop_after=2)) == (34, 0) and len(got) == 2


def test_the_reserved_bit_of_a_stream_id_is_ignored():
    raw = bytearray(h2.frame(h2.DATA, 0, 5, b"ab"))
    raw[5] |= 0x80
    got = []
    h2.read_frames(raw, 100, _collect(got))
    assert got == [(h2.DATA, 0, 5, b"ab")]


@pytest.mark.parametrize("call, payload, code", [
    (h2.unpad, b"", h2.PROTOCOL_ERROR),                                   # no pad length
    (h2.unpad, b"\x03ab", h2.PROTOCOL_ERROR),                             # padding past the frame
    (lambda p: h2.header_fragment(h2.PADDED, p), b"", h2.PROTOCOL_ERROR),
    (lambda p: h2.header_fragment(h2.PADDED | h2.PRIORITY_FLAG, p), b"\x01abcde", h2.PROTOCOL_ERROR),
    (lambda p: h2.header_fragment(h2.PRIORITY_FLAG, p), b"abcd", h2.PROTOCOL_ERROR),
    (h2.window_increment, b"\0\0\0", h2.FRAME_SIZE_ERROR),
    (h2.parse_settings, b"\0\4\0\0\0", h2.FRAME_SIZE_ERROR),
    (h2.parse_settings, b"\0\4\x80\0\0\0", h2.FLOW_CONTROL_ERROR),        # initial window 2^31
    (h2.parse_settings, b"\0\5\0\0\x3f\xff", h2.PROTOCOL_ERROR),          # MAX_FRAME_SIZE 16383
    (h2.parse_settings, b"\0\5\x01\0\0\0", h2.PROTOCOL_ERROR),            # MAX_FRAME_SIZE 2^24
    (h2.parse_settings, b"\0\2\0\0\0\2", h2.PROTOCOL_ERROR),              # ENABLE_PUSH 2
])
def test_malformed_payloads_are_frame_errors_with_the_rfc_code(call, payload, code):
    with pytest.raises(h2.FrameError) as caught:
        call(payload)
    assert caught.value.code == code


# ----------------------------------------------------------------------------- HPACK encoding
@given(st.integers(min_value=0, max_value=1 << 40), st.integers(min_value=1, max_value=8))
def test_integers_encode_as_the_reference_does(value, prefix):
    assert h2.encode_integer(value, prefix) == bytes(reference_integer(value, prefix))


fields = st.lists(st.tuples(st.sampled_from([":path", "x-mq-client-id", "x-mq-request-id", "authorization",
                                              "x-mq-namespace"]),
                            st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80)),
                  max_size=8)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["/s/A", "/s/B"]), fields), min_size=1, max_size=30),
       st.sampled_from([None, 4096, 512, 0]))
def test_request_blocks_decode_with_the_reference_decoder(calls, table_size):
    stable = frozenset((":path", ":authority", "content-type", "te", "grpc-accept-encoding", "user-agent",
                        "x-mq-client-id", "x-mq-namespace"))
    ours, theirs = h2.RequestEncoder("host:1", "http", "test/1", stable), hpack.Decoder()
    for number, (path, metadata) in enumerate(calls):
        if table_size is not None and number == len(calls) // 2:  # the server's SETTINGS come mid-way
            theirs.max_allowed_table_size = table_size
            ours.table_size(table_size)
        block = ours.request(path) + b"".join(ours.field(k, v) for k, v in metadata)
        assert theirs.decode(block) == [(":method", "POST"), (":scheme", "http"), (":path", path),
                                        (":authority", "host:1"), ("content-type", "application/grpc"),
                                        ("te", "trailers"), ("grpc-accept-encoding", "identity,deflate,gzip"),
                                        ("user-agent", "test/1"), *metadata]
        assert theirs.header_table_size <= (table_size if table_size is not None and
                                            number >= len(calls) // 2 else 4096)


# ----------------------------------------------------------------------------- gRPC messages
_COMPRESS = {"gzip": gzip.compress, "deflate": zlib.compress}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=400), st.booleans()), max_size=8),
       st.sampled_from(["gzip", "deflate"]), st.lists(st.integers(min_value=0, max_value=4000), max_size=5))
def test_messages_are_cut_whole_however_the_bytes_arrive(messages, encoding, cuts):
    wire = b""
    for body, compressed in messages:
        data = _COMPRESS[encoding](body) if compressed else body
        wire += bytes([compressed]) + len(data).to_bytes(4, "big") + data
    buf, got = bytearray(), []
    for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(wire)]):
        buf += wire[start:end]
        got += h2.cut_messages(buf, 1 << 20, encoding)
    assert got == [body for body, _ in messages] and not buf


def test_a_length_prefix_over_the_cap_is_refused_before_its_bytes_and_leaves_the_buffer():
    assert h2.cut_messages(bytearray(h2.MESSAGE_PREFIX.pack(0, 1000) + b"y" * 1000), 1000, "identity") == [b"y" * 1000]
    buf = bytearray(h2.MESSAGE_PREFIX.pack(0, 2) + b"ok" + b"\0" + (1001).to_bytes(4, "big") + b"x")
    with pytest.raises(h2.MessageTooLarge) as caught:
        h2.cut_messages(buf, 1000, "identity")
    assert caught.value.length == 1001 and len(buf) == 13


def test_compressed_messages_in_an_unknown_encoding_or_broken_are_refused():
    with pytest.raises(h2.UnsupportedEncoding):
        h2.cut_messages(bytearray(b"\1\0\0\0\1x"), 100, "br")
    with pytest.raises(zlib.error):
        h2.cut_messages(bytearray(b"\1\0\0\0\1x"), 100, "gzip")


@given(st.integers(min_value=0, max_value=16), st.one_of(st.none(), st.text(max_size=60)),
       st.lists(st.tuples(st.sampled_from(["x-a", "x-b-bin"]), st.binary(max_size=20)), max_size=3))
def test_trailers_decode_with_the_reference_decoder(code, details, metadata):
    metadata = [(k, v if k.endswith("-bin") else v.hex()) for k, v in metadata]
    decoded = hpack.Decoder().decode(h2.trailers(code, details, metadata))
    assert decoded[0] == ("grpc-status", str(code))
    rest = decoded[1:]
    if details:
        assert rest[0][0] == "grpc-message" and unquote(rest[0][1], errors="replace") == details
        rest = rest[1:]
    assert [k for k, _ in rest] == [k for k, _ in metadata]


@given(st.floats(min_value=0.001, max_value=99_999_999.0))
def test_grpc_timeouts_read_back(seconds):
    text = h2.timeout_text(seconds)  # at most 8 digits: milliseconds, else whole seconds
    assert len(text) <= 9 and abs(h2.timeout_s(text) - seconds) <= (1.0 if text.endswith("S") else 0.001)
    assert h2.timeout_text(1e12) == "99999999S"  # (longer deadlines are clamped)


@pytest.mark.parametrize("text, seconds", [("1S", 1.0), ("250m", 0.25), ("3H", 10800.0), ("5u", 5e-6), ("", None),
                                           ("S", None), ("123456789m", None), ("1x", None), ("-1S", None)])
def test_grpc_timeout_text(text, seconds):
    assert h2.timeout_s(text) == (seconds if seconds is None else pytest.approx(seconds))


# ----------------------------------------------------------------------------- the package's shape
_PROTOCOL_DIR = pathlib.Path(h2.__file__).parent
_IO_MODULES = {"asyncio", "socket", "ssl", "selectors", "threading", "time", "grpc", "os"}


def _imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", sorted(_PROTOCOL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_the_protocol_package_is_sans_io_and_knows_no_server(path):
    for module, _names in _imports(path):
        assert module.split(".")[0] not in _IO_MODULES, f"{path.name} imports {module}"
        assert not module.startswith(("chronoq.server", "chronoq.client")), f"{path.name} imports {module}"


def test_the_client_transport_takes_only_public_protocol_names():
    client = pathlib.Path(h2.__file__).parents[2] / "client" / "h2channel.py"
    for module, names in _imports(client):
        assert not module.startswith("chronoq.server"), f"h2channel imports {module}"
        if module.startswith("chronoq.protocol"):
            # (the package, or one of its modules for the C types its compiled classes extend: h2channel.pxd)
            assert module.split(".")[:3] == ["chronoq", "protocol", "h2"], (module, names)
            assert not [n for n in names if n.startswith("_")], (module, names)


# ----------------------------------------------------------------------------- flow control
def _windows(conn: int = 1 << 20, stream: int = 1 << 16) -> h2.ConnectionWindows:
    return h2.ConnectionWindows(conn, stream)


def test_the_peers_initial_window_moves_every_open_streams_window():
    w = _windows()
    streams = [h2.StreamWindows(w.peer_initial_window) for _ in range(3)]
    w.spend(streams[0], 1000)
    assert w.peer_settings_window(100_000, streams) == 100_000 - 65_535
    assert [s.send_window for s in streams] == [100_000 - 1000, 100_000, 100_000]
    assert w.peer_settings_window(0, streams) == -100_000  # a window may go negative (RFC 9113 §6.9.2)
    assert [s.send_window for s in streams] == [-1000, 0, 0] and w.room(streams[1]) == 0
    assert w.peer_window == 65_535 - 1000  # the connection's window is not SETTINGS' to move


def test_window_updates_of_zero_or_past_the_maximum_are_the_rfcs_errors():
    w = _windows()
    with pytest.raises(h2.FrameError) as exc:
        w.connection_update(0)
    assert exc.value.code == h2.PROTOCOL_ERROR
    w.connection_update(h2.MAX_WINDOW - w.peer_window)
    assert w.peer_window == h2.MAX_WINDOW
    with pytest.raises(h2.FrameError) as exc:
        w.connection_update(1)
    assert exc.value.code == h2.FLOW_CONTROL_ERROR
    stream = h2.StreamWindows(10)
    assert w.stream_update(stream, 0) == h2.PROTOCOL_ERROR
    assert w.stream_update(stream, h2.MAX_WINDOW - 10) == 0 and stream.send_window == h2.MAX_WINDOW
    assert w.stream_update(stream, 1) == h2.FLOW_CONTROL_ERROR


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=20), st.integers(0, 70_000), st.integers(0, 70_000),
       st.sampled_from([1000, 16_384]))
def test_data_out_takes_what_both_windows_allow_and_spends_it(chunks, stream_window, conn_window, max_frame):
    w = _windows()
    w.peer_window = conn_window
    stream = h2.StreamWindows(stream_window)
    for data in chunks:
        room = min(stream.send_window, w.peer_window)
        frames, taken = w.data_out(7, stream, data, max_frame)
        assert taken == min(len(data), max(room, 0))
        assert b"".join(bytes(_parse(f).data) for f in frames) == data[:taken]
        assert (stream.send_window, w.peer_window) == (stream_window - taken, conn_window - taken)
        stream_window, conn_window = stream.send_window, w.peer_window


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40_000), max_size=60))
def test_received_bytes_are_granted_back_once_half_a_window_is_used(sizes):
    # data_in (a client's rule) and received/stream_received + grant_* (the server's, which may
    # hold grants back) count alike: every byte is granted back, never more than half a window owed.
    w, stream = _windows(100_000, 30_000), h2.StreamWindows(0)
    w2, stream2 = _windows(100_000, 30_000), h2.StreamWindows(0)
    granted = {0: 0, 5: 0}
    for n in sizes:
        out = w.data_in(5, stream, n)
        updates = [_parse(out[i:i + 13]) for i in range(0, len(out), 13)]
        for u in updates:
            assert isinstance(u, WindowUpdateFrame) and u.window_increment > 0
            granted[u.stream_id] += u.window_increment
        assert w.recv_unacked < 50_000 and stream.recv_unacked < 15_000
        if w2.received(n):
            assert w2.grant_connection()
        if w2.stream_received(stream2, n):
            assert w2.grant_stream(5, stream2)
        assert (w2.recv_unacked, stream2.recv_unacked) == (w.recv_unacked, stream.recv_unacked)
    assert granted[0] + w.recv_unacked == sum(sizes) == granted[5] + stream.recv_unacked
    assert w.opening_update() == h2.window_update_frame(0, 100_000 - h2.DEFAULT_WINDOW)


_HEAD = [(":method", "POST"), (":scheme", "http"), (":path", "/svc/M"), (":authority", "a:1")]


def test_request_head_splits_the_transport_from_the_metadata():
    """(Guards a move: the reading of a request's header fields, from chronoq.server.h2calls.)"""
    fields = [(":path", "/svc/M"), (":method", "POST"), (":scheme", "http"), (":authority", "a:1"),
              ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "10S"),
              ("x-mq-client-id", "c1"), ("trace-bin", "AAEC"), ("bad-bin", "A"),
              ("grpc-encoding", "gzip"), ("user-agent", "grpc"), ("x-mq-client-id", "c2")]
    path, metadata, timeout, encoding, bad, malformed = h2.request_head(fields)
    assert (path, timeout, encoding, bad, malformed) == ("/svc/M", 10.0, "gzip", None, None)
    assert metadata == (("grpc-timeout", "10S"), ("x-mq-client-id", "c1"), ("trace-bin", b"\x00\x01\x02"),
                        ("grpc-encoding", "gzip"), ("x-mq-client-id", "c2"))
    get = [(k, "GET" if k == ":method" else v) for k, v in _HEAD]
    assert h2.request_head(get)[4:] == ("method GET (gRPC calls are POST)", None)
    assert h2.request_head(_HEAD + [("content-type", "text/plain")])[4:] == ("content-type 'text/plain'", None)


@pytest.mark.parametrize("fields, says", [
    ([], "needs :method, :scheme"),
    ([f for f in _HEAD if f[0] != ":scheme"], "needs :method, :scheme"),
    ([(k, "" if k == ":path" else v) for k, v in _HEAD], "needs :method, :scheme"),
    ([("x-a", "1")] + _HEAD, "after a regular field"),
    (_HEAD[:2] + [("te", "trailers")] + _HEAD[2:], "after a regular field"),
    (_HEAD + [(":path", "/svc/N")], "twice"),
    (_HEAD + [(":status", "200")], ":status in a request"),
    (_HEAD + [(":unknown", "x")], ":unknown in a request"),
    (_HEAD + [("X-Upper", "1")], "'X-Upper' is not allowed"),
    (_HEAD + [("", "1")], "'' is not allowed"),
    (_HEAD + [("connection", "keep-alive")], "'connection' is not allowed"),
    (_HEAD + [("transfer-encoding", "chunked")], "'transfer-encoding' is not allowed"),
    (_HEAD + [("te", "gzip")], "te: 'gzip'"),
])
def test_malformed_request_heads_are_named(fields, says):
    """RFC 9113 section 8.3: what makes a request malformed (the server resets its stream)."""
    malformed = h2.request_head(fields)[5]
    assert malformed is not None and says in malformed, malformed


def test_request_head_remembers_a_bounded_number_of_names():
    from chronoq.protocol.h2 import grpcmsg

    names = [f"x-name-{i}" for i in range(grpcmsg.FIELD_KINDS_MAX + 50)] + ["late-bin", "late-name"]
    path, metadata, *_ = h2.request_head([(":path", "/svc/M")] + [(n, "AAEC") for n in names])
    assert path == "/svc/M" and len(grpcmsg._FIELD_KINDS) <= grpcmsg.FIELD_KINDS_MAX
    # past the bound, names are still read right (classified anew each time)
    assert metadata[-2] == ("late-bin", b"\x00\x01\x02") and metadata[-1] == ("late-name", "AAEC")
    assert len(metadata) == len(names)
