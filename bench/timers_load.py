"""The load processes of bench/timers.py's served parts (b, c): a producer that sends timers due
at a steady rate (each a lead ahead, or all preloaded), consumers that receive and ack them and
record each message's due, stored and received times, and the collection of what they report.
Children of a spawn context: each starts clean (no forked gRPC state)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

SEND_BATCH_MAX = 1000       # messages per SendMessage request (the broker takes up to 1024)
RECEIVE_BATCH = 32
CONSUMERS = 2               # consumer processes
CONSUMER_LANES = 2          # receives in flight per consumer process
SEND_AHEAD_S = 0.010        # b: the producer sends what falls due within this much more time
MP = mp.get_context("spawn")  # children start clean (no forked gRPC state)


def _producer(endpoint: str, topic: str, rate: int, seconds: float, lead_s: float, t0: float, out,
              preload: bool = False) -> None:
    """Send ``rate * seconds`` timers, message i due at t0 + lead_s + i/rate: each sent lead_s
    before it is due (live), or all of them at once, before the first is due (preload)."""
    from chronoq.client.client import Client, OutgoingMessage, run

    total = int(rate * seconds)
    body = os.urandom(100)
    base_ms = t0 * 1000 + lead_s * 1000

    async def go_preload() -> dict:
        started = time.time()
        async with Client(endpoint, request_timeout_s=60) as client:
            async def lane(k: int) -> None:
                for first in range(k * SEND_BATCH_MAX, total, 4 * SEND_BATCH_MAX):
                    n = min(SEND_BATCH_MAX, total - first)
                    await client.send_batch([
                        OutgoingMessage(topic, body, deliver_at_ms=int(base_ms + (first + i) * 1000 / rate))
                        for i in range(n)])

            await asyncio.gather(*(lane(k) for k in range(4)))
        done = time.time()
        return {"sent": total, "send_s": round(done - started, 1), "sent_ahead_s": round(base_ms / 1000 - done, 1)}

    async def go() -> dict:
        sent = late_sends = 0
        hard = t0 + seconds + lead_s + 60
        async with Client(endpoint, request_timeout_s=30) as client:
            while sent < total and time.time() < hard:
                # Send in ~10 ms batches (the lead is seconds), not one request per message.
                upto = min(total, int((time.time() - t0 + SEND_AHEAD_S) * rate))
                if upto <= sent:
                    await asyncio.sleep(0.002)
                    continue
                n = min(upto - sent, SEND_BATCH_MAX)
                base_ms = t0 * 1000 + lead_s * 1000
                batch = [OutgoingMessage(topic, body, deliver_at_ms=int(base_ms + (sent + i) * 1000 / rate))
                         for i in range(n)]
                if batch[0].deliver_at_ms <= time.time() * 1000 + 1000:
                    late_sends += n  # the producer fell behind its lead: these were not sent ahead
                await client.send_batch(batch)
                sent += n
        return {"sent": sent, "late_sends": late_sends}

    out.put(("producer", run(go_preload() if preload else go())))


def _consumer(endpoint: str, group: str, topic: str, expected: int, counter, give_up_at: float, out,
              pause_ms: int = 0) -> None:
    """Receive and ack until ``counter`` (shared by the consumers) reaches ``expected``. After a
    receive that was not full, a lane pauses ``pause_ms`` so the next one takes a bigger batch."""
    from chronoq.client.client import Client, run

    rows: list[tuple[str, int, int, int]] = []  # (message id, due ms, store ms, receive ms)
    receives = [0]

    async def lane(client) -> None:
        while counter.value < expected and time.time() < give_up_at:
            try:
                got = await client.receive(group, topic, max_messages=RECEIVE_BATCH, invisible_s=120, wait_s=1)
            except Exception:  # noqa: BLE001 - a slow answer: try again (bounded by give_up_at)
                continue
            recv_ms = int(time.time() * 1000)
            if not got:
                continue
            receives[0] += 1
            await client.ack(group, topic, got)
            rows.extend((m.message_id, m.deliver_at_ms, m.store_ms, recv_ms) for m in got)
            with counter.get_lock():
                counter.value += len(got)
            if pause_ms and len(got) < RECEIVE_BATCH:
                await asyncio.sleep(pause_ms / 1000)

    async def go() -> None:
        async with Client(endpoint, request_timeout_s=30) as client:
            await asyncio.gather(*(lane(client) for _ in range(CONSUMER_LANES)))

    run(go())
    out.put(("consumer", rows))
    out.put(("receives", receives[0]))


def _start_consumers(endpoint: str, group: str, topic: str, expected: int, give_up_at: float, out,
                     pause_ms: int = 0):
    counter = MP.Value("q", 0)
    procs = [MP.Process(target=_consumer, args=(endpoint, group, topic, expected, counter, give_up_at, out,
                                                pause_ms))
             for _ in range(CONSUMERS)]
    for p in procs:
        p.start()
    procs.append(counter)  # keep the shared counter alive until the children are done with it
    return procs


def _collect(out, procs: list, kinds: dict, timeout_s: float) -> dict:
    got: dict = {}
    deadline = time.time() + timeout_s
    while sum(kinds.values()) > sum(len(v) for v in got.values()) and time.time() < deadline:
        try:
            kind, value = out.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: look again until the deadline
            continue
        got.setdefault(kind, []).append(value)
    for p in procs:
        if not hasattr(p, "join"):
            continue  # the shared counter
        p.join(10)
        if p.is_alive():
            p.kill()
    return got
