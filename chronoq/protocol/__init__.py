"""Wire protocols, sans-IO: bytes in, values out, and back. Nothing here opens a socket or reads a
clock, so the client and the server share it. ``h2``: HTTP/2 framing and HPACK; ``wire``: the
RocketMQ messages chronoq encodes by hand (each checked against the generated classes in tests)."""
