"""The client's SendMessageRequest encoding, in process: CPU per message of
``chronoq.client.client.Client._send_request_bytes`` for the shapes producers send.

No server, no socket: only the encoder (what a producer's process spends per message before the
transport). Shapes: a batch of 100 plain one-KiB messages (bench/send_receive.py phase b), the
same delayed (phase d: delivery times spread over 10 minutes), a lone plain message (phase e),
and a batch of 100 with a tag, a key and a user property each.

Prints one JSON object per line: {"metric", "value", "unit", ...context}; the value is the median
of ``--repeats`` timings of ``--messages`` messages each (process CPU time).

    .venv/bin/python bench/client_encode.py
    .venv/bin/python bench/client_encode.py --repeats 15 --messages 100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chronoq.client.client import Client, OutgoingMessage  # noqa: E402
from chronoq.protocol.rocketmq import fields  # noqa: E402

BODY = b"x" * 1024


def _client() -> Client:
    client = Client.__new__(Client)  # no channel: only the encoder is timed
    client.namespace = ""
    client._topic_fields = {}
    client._born_host = fields.string_field(fields.K_SP_BORN_HOST, "bench-host")
    try:  # (the encoder's home since issue 21; the bench also runs against trees before it)
        from chronoq.protocol.rocketmq.outgoing import SendRequestEncoder
        client._encoder = SendRequestEncoder("", "bench-host")
    except ImportError:
        pass
    return client


def _batches(shape: str, batch: int, count: int) -> list[list[OutgoingMessage]]:
    now = int(time.time() * 1000)
    out = []
    for b in range(max(1, count // batch)):
        if shape == "plain":
            out.append([OutgoingMessage("bench", BODY) for _ in range(batch)])
        elif shape == "delayed":
            out.append([OutgoingMessage("bench", BODY, deliver_at_ms=now + 1000 + (b * batch + i) * 600_000 // count)
                        for i in range(batch)])
        else:
            out.append([OutgoingMessage("bench", BODY, tag="TagA", keys=(f"k{i}",), properties={"color": "red"})
                        for i in range(batch)])
    return out


def measure(shape: str, batch: int, messages: int, repeats: int) -> float:
    client = _client()
    encode = client._send_request_bytes
    batches = _batches(shape, batch, messages)
    for m in batches[:10]:
        encode(m)  # warm the caches
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for m in batches:
            encode(m)
        times.append((time.process_time() - t0) / (len(batches) * batch) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50_000, help="messages per timing (bounded)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    messages = min(args.messages, 1_000_000)
    for shape, batch in (("plain", 100), ("delayed", 100), ("plain", 1), ("tagged", 100)):
        n = messages if batch > 1 else messages // 10
        us = measure(shape, batch, n, args.repeats)
        print(json.dumps({"metric": f"client_encode_{shape}_b{batch}", "value": round(us, 3), "unit": "us/msg",
                          "messages": n, "repeats": args.repeats, "body_bytes": len(BODY)}), flush=True)


if __name__ == "__main__":
    main()
