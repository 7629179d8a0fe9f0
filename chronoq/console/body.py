"""How the lookup page shows a message body: as text when it is UTF-8 text, else as a hex dump;
size-limited either way. Pure.

The lookup keeps the first ``BODY_HEAD_BYTES`` (4 KiB) of each record's body
(``chronoq.features.lookup``); the page shows at most ``TEXT_CHARS_MAX`` characters of text or
``HEX_BYTES_MAX`` bytes as hex (a hex dump is four times the size of what it shows), and says
how much it left out.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT_CHARS_MAX = 4096
HEX_BYTES_MAX = 1024
HEX_ROW = 16
_TEXT_CONTROLS = {"\n", "\r", "\t"}


@dataclass(frozen=True, slots=True)
class BodyView:
    kind: str        # "text", "hex" or "empty"
    text: str        # what the page prints (in a <pre>: escaped by the template)
    shown: int       # bytes of the body shown
    total: int       # bytes of the whole body

    @property
    def truncated(self) -> bool:
        return self.shown < self.total


def _as_text(head: bytes, cut: bool) -> str | None:
    """``head`` as text if it is UTF-8 without control characters (other than new lines and
    tabs), else None. When ``head`` was cut from a longer body, up to 3 trailing bytes of a
    character split by the cut are dropped, not taken for binary."""
    for trim in range(4 if cut else 1):
        try:
            text = head[:len(head) - trim].decode("utf-8")
        except UnicodeDecodeError:
            continue
        ok = all(ch.isprintable() or ch in _TEXT_CONTROLS for ch in text)
        return text if ok else None
    return None


def hex_dump(data: bytes) -> str:
    """Rows of 16 bytes: offset, hex bytes, and the printable ASCII characters ('.' otherwise)."""
    rows = []
    for at in range(0, len(data), HEX_ROW):
        chunk = data[at:at + HEX_ROW]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        ascii_ = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        rows.append(f"{at:08x}  {hexes:<{HEX_ROW * 3 - 1}}  |{ascii_}|")
    return "\n".join(rows)


def body_view(head: bytes, total: int) -> BodyView:
    """The view of a body of ``total`` bytes whose first bytes are ``head``.

    Ensures: ``shown <= len(head) <= total``; text holds at most ``TEXT_CHARS_MAX`` characters,
    a hex dump at most ``HEX_BYTES_MAX`` bytes."""
    assert len(head) <= total
    if total == 0:
        return BodyView("empty", "", 0, 0)
    text = _as_text(head, cut=len(head) < total)
    if text is not None:
        text = text[:TEXT_CHARS_MAX]
        return BodyView("text", text, len(text.encode("utf-8")), total)
    shown = head[:HEX_BYTES_MAX]
    return BodyView("hex", hex_dump(shown), len(shown), total)
