"""chronoq's HPACK decoder against the reference encoder of the ``hpack`` package."""

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.protocol.h2.hpackdec import Decoder, HpackError
from chronoq.protocol.h2.hpackenc import literal_block

names = st.sampled_from([":path", ":method", "content-type", "grpc-timeout", "x-mq-client-id",
                         "x-mq-request-id", "user-agent", "authorization", "x-custom"])
values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
blocks = st.lists(st.lists(st.tuples(names, values), min_size=1, max_size=12), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(blocks, st.sampled_from([4096, 256, 0]), st.booleans())
def test_decodes_what_the_reference_encoder_writes(seq, table_size, huffman):
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size  # emits a size update in the next block
    ours = Decoder()
    for fields in seq:
        block = encoder.encode(fields, huffman=huffman)
        assert ours.decode(block) == [(n, v) for n, v in fields]
    assert ours.size <= ours.max_size


def test_a_long_connection_evicts_and_stays_in_step():
    encoder, ours = hpack.Encoder(), Decoder()
    for i in range(2000):
        fields = [(":path", "/svc/M"), ("x-mq-request-id", f"id-{i:06d}-" + "x" * (i % 50)), ("te", "trailers")]
        assert ours.decode(encoder.encode(fields)) == fields
    assert ours.size <= 4096


@pytest.mark.parametrize("block, why", [
    (b"\xbf\xff\xff\xff\x0f", "beyond"),    # index far past both tables
    (b"\x80", "index 0"),
    (b"\x40\x85ab", "truncated"),          # name longer than the block
    (b"\x3f\xe2\x1f", "over the advertised"),  # size update to 4097
    (b"\xff\xff\xff\xff\xff\xff\xff", "integer"),
])
def test_malformed_blocks_raise(block, why):
    with pytest.raises(HpackError, match=why):
        Decoder().decode(block)


def test_answer_blocks_decode_with_the_reference_decoder():
    block = literal_block([(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0")])
    assert hpack.Decoder().decode(block) == [(":status", "200"), ("content-type", "application/grpc"),
                                             ("grpc-status", "0")]


# ----------------------------------------------------------------------------- Huffman
def _huffman(data: bytes) -> bytes:
    from hpack.huffman import HuffmanEncoder
    from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

    return HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_huffman_decode_inverts_the_reference_encoder(data):
    from hpack.huffman_table import decode_huffman

    from chronoq.protocol.h2.hpackdec import huffman_decode

    coded = _huffman(data)
    assert huffman_decode(coded) == data == decode_huffman(coded)


@pytest.mark.parametrize("coded, why", [
    (b"\x00", "padding"),                    # '0' is 00000: then three 0-bits, not a prefix of EOS
    (_huffman(b"ab") + b"\xff", "padding"),  # a whole byte of padding
    (b"\xff\xff\xff\xff", "EOS"),            # thirty 1-bits: the EOS symbol inside the string
])
def test_huffman_decode_refuses_bad_padding_and_eos(coded, why):
    from chronoq.protocol.h2.hpackdec import huffman_decode

    with pytest.raises(HpackError, match=why):
        huffman_decode(coded)


def test_huffman_decode_takes_padding_of_up_to_seven_one_bits():
    from chronoq.protocol.h2.hpackdec import huffman_decode

    assert huffman_decode(b"\x07") == b"0"   # 00000 111
    assert huffman_decode(_huffman(b"x-mq-request-id")) == b"x-mq-request-id"


def test_a_name_from_the_dynamic_table_is_read_anew_each_time():
    """The same bytes of a literal whose name is a dynamic-table index name different fields as
    the table moves: they must not be answered from the field cache."""
    ours = Decoder()
    assert ours.decode(b"\x40\x03x-a\x011") == [("x-a", "1")]        # table[62] = x-a
    by_index = b"\x0f\x2f\x01v"                                       # name: index 62, value "v"
    assert ours.decode(by_index) == [("x-a", "v")]
    assert ours.decode(b"\x40\x03x-b\x012") == [("x-b", "2")]        # now table[62] = x-b
    assert ours.decode(by_index) == [("x-b", "v")]
    # A name spelled out (or static) means the same on every connection: cached, still right.
    other = Decoder()
    assert other.decode(b"\x00\x03x-c\x01w") == [("x-c", "w")] == ours.decode(b"\x00\x03x-c\x01w")


# ---------------------------------------------------------------------------------- the previous block's fields
def _grpcio_like(request_id: str) -> list:
    """The shape of grpcio's requests: fields it indexed once, then literals without indexing."""
    return [(":path", "/svc/M"), (":authority", "127.0.0.1:1"), ("te", "trailers"), ("x-mq-language", "PYTHON"),
            hpack.NeverIndexedHeaderTuple("x-mq-date-time", "20261127T054224Z"),
            hpack.NeverIndexedHeaderTuple("x-mq-request-id", request_id),
            hpack.NeverIndexedHeaderTuple("authorization", "MQv2-HMAC-SHA1 Signature=4e06")]


def test_a_block_takes_the_fields_it_repeats_from_the_one_before():
    encoder, ours = hpack.Encoder(), Decoder()
    for i in range(5):
        fields = _grpcio_like(f"id-{i}")
        assert ours.decode(encoder.encode(fields)) == [tuple(f) for f in fields]
    assert ours.taken == 5  # the indexed four and the date; from the request id on, decoded


def test_alternating_calls_take_from_the_block_before_the_previous_one():
    """A consumer alternates two calls (receive, ack): each block differs from the previous one
    at ``:path`` and runs on to the request id with the one before it."""
    encoder, ours = hpack.Encoder(), Decoder()

    def call(path: str, request_id: str) -> list:
        fields = _grpcio_like(request_id)
        fields[0] = (":path", path)
        return fields

    for i in range(6):
        fields = call("/svc/Receive" if i % 2 == 0 else "/svc/Ack", f"id-{i}")
        assert ours.decode(encoder.encode(fields)) == [tuple(f) for f in fields]
    assert ours.taken == 5  # from the block before the previous one, as a lone call's block does
    # Three paths in turn: no earlier block shares the path; only what precedes it could be taken.
    for i in range(6):
        fields = call(("/svc/A", "/svc/B", "/svc/C")[i % 3], f"x-{i}")
        assert ours.decode(encoder.encode(fields)) == [tuple(f) for f in fields]
    assert ours.taken == 0


def test_a_table_change_stops_the_taking():
    """Fields taken from the previous block are those it decoded against the same table: an
    indexing literal or a size update (here, or in the previous block) moves the table."""
    encoder, ours = hpack.Encoder(), Decoder()
    ours.decode(encoder.encode(_grpcio_like("a")))  # (indexes the first four)
    second = encoder.encode(_grpcio_like("a"))
    ours.decode(second)
    assert ours.decode(second) == [tuple(f) for f in _grpcio_like("a")] and ours.taken == 7
    encoder.header_table_size = 256  # a size update first: the table may have lost entries
    moved = encoder.encode(_grpcio_like("b"))
    assert ours.decode(moved) == [tuple(f) for f in _grpcio_like("b")] and ours.taken == 0
    again = encoder.encode(_grpcio_like("c"))
    assert ours.decode(again) == [tuple(f) for f in _grpcio_like("c")]
    # A reference to the dynamic table means what the table holds now, whatever the bytes.
    ours = Decoder()
    assert ours.decode(b"\x40\x03x-a\x011\xbe") == [("x-a", "1"), ("x-a", "1")]
    assert ours.decode(b"\xbe\x40\x03x-b\x012") == [("x-a", "1"), ("x-b", "2")]
    assert ours.decode(b"\xbe") == [("x-b", "2")]  # the bytes of the block before, another field


fields_or_hidden = st.lists(st.tuples(names, values, st.booleans()), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(fields_or_hidden, st.lists(st.tuples(st.integers(0, 12), fields_or_hidden), min_size=1, max_size=10),
       st.booleans())
def test_blocks_that_repeat_a_prefix_decode_as_the_reference_decoder_does(first, changes, huffman):
    """Each block keeps the first k fields of the one before and changes the rest; a field is
    indexed or never indexed (as grpcio writes its metadata)."""
    encoder, reference, ours = hpack.Encoder(), hpack.Decoder(), Decoder()
    fields = first
    for keep, rest in [(0, first)] + changes:
        fields = fields[:keep] + rest
        block = encoder.encode([hpack.NeverIndexedHeaderTuple(n, v) if hidden else (n, v)
                                for n, v, hidden in fields], huffman=huffman)
        assert ours.decode(block) == [tuple(f) for f in reference.decode(block)]


def test_a_table_size_update_is_not_counted_as_header_list():
    # (A size update's value once landed in the header list's count: a block with one over a
    # small cap's bound was refused.)
    block = b"\x3f\xe1\x1f" + b"".join(b"\x00\x03x-" + bytes([97 + i]) + b"\x01v" for i in range(20))
    assert len(Decoder(max_list=1000).decode(block)) == 20


# ---------------------------------------------------------------------------------- header list cap
def test_an_hpack_bomb_stops_while_decoding():
    import hpack

    from chronoq.protocol.h2.hpackdec import HeaderListTooLarge

    encoder = hpack.Encoder()
    bomb = encoder.encode([("x-big", "a" * 4000)] * 16_000)  # one entry, then 1-byte references
    assert len(bomb) < 20_000
    decoder = Decoder()
    try:
        decoder.decode(bomb)
        raise AssertionError("the bomb decoded")
    except HeaderListTooLarge as exc:
        assert "65536" in str(exc)


def test_the_header_list_cap_counts_32_bytes_per_field():
    import hpack

    from chronoq.protocol.h2.hpackdec import HeaderListTooLarge

    fields = [(f"x-{i:03d}", "v" * 95) for i in range(10)]  # 100 + 32 each: 1,320 bytes
    for huffman in (True, False):
        block = b"".join(hpack.Encoder().encode([f], huffman=huffman) for f in fields)
        assert Decoder(max_list=1320).decode(block) == fields
        try:
            Decoder(max_list=1319).decode(block)
            raise AssertionError("one byte over the cap decoded")
        except HeaderListTooLarge:
            pass
    # references to the dynamic table, names and whole fields
    encoder = hpack.Encoder()
    first = encoder.encode(fields)
    again = encoder.encode(fields)
    decoder = Decoder(max_list=1320)
    assert decoder.decode(first) == fields and decoder.decode(again) == fields
    decoder = Decoder(max_list=1319)
    try:
        decoder.decode(first)
        raise AssertionError("one byte over the cap decoded")
    except HeaderListTooLarge:
        pass
