"""Wire protocols, sans-IO: bytes in, values out, and back. Nothing here opens a socket or reads a
clock, so the client and the server share it. ``h2``: HTTP/2 framing, HPACK and gRPC's message
framing; ``rocketmq``: the RocketMQ v2 messages chronoq encodes by hand, one field-number table
and one encoder per message shape (each checked against the generated classes in tests)."""
