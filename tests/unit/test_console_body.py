"""How the console's lookup shows a body (chronoq.console.body): text or hex, size-limited."""

from __future__ import annotations

from chronoq.console import body
from chronoq.features.lookup import BODY_HEAD_BYTES


def test_text_is_shown_as_text():
    v = body.body_view("order 42 paid\n\tthank you, Zoë".encode(), len("order 42 paid\n\tthank you, Zoë".encode()))
    assert v.kind == "text" and v.text == "order 42 paid\n\tthank you, Zoë" and not v.truncated


def test_long_text_is_cut_at_the_limit_and_says_so():
    data = ("é" * 10_000).encode()  # 20,000 bytes; the lookup keeps the first BODY_HEAD_BYTES
    v = body.body_view(data[:BODY_HEAD_BYTES], len(data))
    assert v.kind == "text"
    assert len(v.text) <= body.TEXT_CHARS_MAX and set(v.text) == {"é"}
    assert v.truncated and v.total == 20_000 and v.shown == len(v.text.encode())


def test_a_character_split_by_the_cut_does_not_make_text_binary():
    data = "a€".encode() * 2000  # 3-byte characters: a cut at any byte may split one
    for cut in range(1, 8):
        v = body.body_view(data[:cut + 100], len(data))
        assert v.kind == "text", cut


def test_binary_is_shown_as_hex_up_to_its_limit():
    data = bytes(range(256)) * 10
    v = body.body_view(data[:BODY_HEAD_BYTES], len(data))
    assert v.kind == "hex" and v.shown == body.HEX_BYTES_MAX and v.total == 2560 and v.truncated
    rows = v.text.splitlines()
    assert len(rows) == body.HEX_BYTES_MAX // body.HEX_ROW
    assert rows[4] == "00000040  40 41 42 43 44 45 46 47 48 49 4a 4b 4c 4d 4e 4f  |@ABCDEFGHIJKLMNO|"
    assert rows[0].endswith("|................|")


def test_control_characters_make_a_body_binary():
    assert body.body_view(b"abc\x00def", 7).kind == "hex"
    assert body.body_view(b"\x1b[31mred", 8).kind == "hex"


def test_empty_body():
    v = body.body_view(b"", 0)
    assert v.kind == "empty" and v.text == "" and not v.truncated
