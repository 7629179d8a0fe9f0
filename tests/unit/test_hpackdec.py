"""chronoq's HPACK decoder against the reference encoder of the ``hpack`` package."""

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.server.hpackdec import Decoder, HpackError, literal_block

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
