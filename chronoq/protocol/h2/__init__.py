"""HTTP/2 (RFC 9113), HPACK (RFC 7541) and gRPC's framing on them: what chronoq's server
(``chronoq.server.h2server``) and client transport (``chronoq.client.h2channel``) share.

Sans-IO, as h11 is: bytes and numbers in, bytes and values out; no sockets, no event loop, no
clock. The modules: ``frames`` (frame constants, frames to bytes and back), ``settings``
(SETTINGS and the windows' bounds), ``flow`` (the flow-control counters of a connection and its
streams, both ways, and the rules that move them), ``hpackdec`` and ``hpackenc`` (header blocks),
``grpcmsg`` (gRPC's length-prefixed messages, compression, status trailers, timeouts). Their
public names are re-exported here; import them from ``chronoq.protocol.h2``.
"""

from types import ModuleType as _ModuleType

from chronoq.protocol.h2.frames import (ACK, CANCEL, COMPRESSION_ERROR, CONTINUATION, DATA, END_HEADERS, END_STREAM,
                                        ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_HEAD, FRAME_SIZE_ERROR, GOAWAY,
                                        GOAWAY_DEBUG_MAX, HEADERS, HEADERS_EXTRAS, INTERNAL_ERROR, MAX_FRAME_LENGTH,
                                        NO_ERROR, PADDED, PING, PREFACE, PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR,
                                        PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, SETTINGS, STREAM_CLOSED, U32,
                                        WINDOW_UPDATE,
                                        FrameError, data_frames, frame, goaway_frame, header_fragment, headers_frame,
                                        parse_goaway, read_frames, rst_stream_frame, unpad, window_increment,
                                        window_update_frame)
from chronoq.protocol.h2.flow import ConnectionWindows, StreamWindows
from chronoq.protocol.h2.grpcmsg import (MESSAGE_PREFIX, MessageTooLarge, Parts, UnsupportedEncoding, cut_messages,
                                         decompress, request_head, timeout_s, timeout_text, trailers)
from chronoq.protocol.h2.hpackdec import STATIC_LEN, Decoder, HeaderListTooLarge, HpackError
from chronoq.protocol.h2.hpackenc import RequestEncoder, encode_integer, literal, literal_block
from chronoq.protocol.h2.settings import (DEFAULT_MAX_FRAME, DEFAULT_WINDOW, MAX_WINDOW, SETTING, SETTINGS_ACK,
                                          S_ENABLE_PUSH, S_HEADER_TABLE_SIZE, S_INITIAL_WINDOW_SIZE,
                                          S_MAX_CONCURRENT_STREAMS, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE,
                                          parse_settings, settings_frame)

__all__ = [name for name, value in list(globals().items())
           if not name.startswith("_") and not isinstance(value, _ModuleType)]
