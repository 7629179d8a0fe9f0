"""kill -9 crash test of the committer (chronoq/broker/committer.py) under mixed load.

A real ``chronoq serve`` is SIGKILLed at seeded moments while, all at once:

- plain sends (single messages and small batches) go to ``cc-plain``;
- delayed sends (due 0.3-3 s ahead) go to ``cc-delay``, and further ones (due 5-8 s ahead) are
  recalled at once, about half of them;
- FIFO sends (three message groups) go to ``cc-fifo``;
- transactional sends (raw RocketMQ calls: a half, then EndTransaction COMMIT or ROLLBACK, seeded)
  go to ``cc-txn``;
- consumers receive and ack every topic (acks advance the groups' consume offsets).

Each lane records what the broker *acknowledged*: a send answered OK, a recall answered OK, an
EndTransaction answered OK. Anything in flight at a kill has an unknown outcome and is not counted.
After the last kill the broker is restarted, the senders stop, every due time passes, and the
consumers drain. Checked:

- every acknowledged send (plain, FIFO, delayed and not recalled, committed transaction) is received,
  and is in its topic's consume queues when the data directory is audited after a clean stop;
- nothing is delivered early: a delayed message's stored time and the consumer's clock when its
  receive returned are at or after its due time;
- nothing acknowledged as recalled or rolled back is ever delivered or in its topic;
- after a clean stop and restart, nothing acknowledged is received again (consume offsets are durable);
- the consume queues equal a rebuild from the commit log alone (queues and checkpoint deleted, the
  store reopened), entry for entry.

SIGKILL ends the process, not the machine: bytes written but not fsynced survive in the page cache,
so this checks ordering and bookkeeping across restarts (what is acknowledged, dispatched, completed),
not the fsync itself (tests/unit/test_committer.py checks that a ticket waits for it).
Seed: ``CHRONOQ_COMMITTER_CRASH_SEED`` (printed); kills: ``CHRONOQ_COMMITTER_CRASH_KILLS``.
The seed fixes the kill gaps and the workload's choices; where a kill lands depends on the machine.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.broker.broker import Broker
from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, ClientError, OutgoingMessage
from chronoq.core.config import load_config
from chronoq.store.store import Store
from tests.integration.conftest import ChronoqProcess, groups_toml

SEED = int(os.environ.get("CHRONOQ_COMMITTER_CRASH_SEED", "20261126"))
KILLS = int(os.environ.get("CHRONOQ_COMMITTER_CRASH_KILLS", "4"))
KILL_GAP_S = (0.5, 2.0)          # a kill comes this long (seeded, uniform) after the broker is ready
SHORT_DELAY_S = (0.3, 3.0)       # delayed sends fall due this far ahead
RECALL_DELAY_S = (5.0, 8.0)      # sends to recall: due far enough ahead that the recall comes first
DRAIN_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 5.0
INVISIBLE_S = 2
FIFO_GROUPS = 3
PLAIN, DELAY, FIFO, TXN = "cc-plain", "cc-delay", "cc-fifo", "cc-txn"
GROUP, FIFO_GROUP = "cc-g", "cc-fifo-g"
META = (("x-mq-client-id", "committer-crash@1@1@txn"),)
CONFIG = """
checkpoint_interval_ms = 500
timer_bucket_ms = 1000
timer_preload_ms = 2000
default_queues = 2
txn_check_after_ms = 600000
""" + groups_toml({FIFO_GROUP: {"fifo": True}})


@dataclass
class State:
    proc: ChronoqProcess
    rng: random.Random
    sending: bool = True
    consuming: bool = True
    acked: dict[str, tuple[str, int]] = field(default_factory=dict)  # message id -> (topic, due ms or 0)
    recalled: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    received: dict[str, int] = field(default_factory=dict)  # message id -> receives
    early: list[tuple] = field(default_factory=list)
    errors: int = 0
    refused: list[str] = field(default_factory=list)  # a broker's error answer to a valid send

    @property
    def endpoint(self) -> str:
        return self.proc.endpoint


def tally(state, got, got_ms: int) -> None:
    """Count each delivery in ``state.received``; note in ``state.early`` one seen before its due
    time (stored before it, or received before it by this machine's clock, the broker's)."""
    for m in got:
        state.received[m.message_id] = state.received.get(m.message_id, 0) + 1
        if m.deliver_at_ms and (m.store_ms < m.deliver_at_ms or got_ms < m.deliver_at_ms):
            state.early.append((m.message_id, m.store_ms, m.deliver_at_ms, got_ms))


async def stop_sending_and_drain(state, senders) -> None:
    """Stop the senders, then wait (bounded: the last due time + DRAIN_TIMEOUT_S) until every
    acknowledged message has been received."""
    state.sending = False
    await asyncio.gather(*senders)
    last_due_ms = max((due for _, due in state.acked.values()), default=0)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S + max(0.0, last_due_ms / 1000 - time.time())
    while time.monotonic() < deadline and not set(state.acked) <= set(state.received):
        await asyncio.sleep(0.2)


def timer_pending(proc: ChronoqProcess) -> int:
    """Delayed messages a running broker has not delivered yet
    (``chronoq_timer_pending_messages{horizon="inf"}`` on its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    match = re.search(r'^chronoq_timer_pending_messages\{horizon="inf"\} (\S+)$', text, re.M)
    assert match, 'no chronoq_timer_pending_messages{horizon="inf"} on /metrics'
    return int(float(match.group(1)))


async def kill_9_and_restart(state, config: str) -> None:
    """SIGKILL ``state.proc`` (it must die of it), then start a new process on its data directory
    (the lanes reconnect to it by themselves)."""
    state.proc.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(state.proc.proc.wait, 10)
    state.proc.stop(check=False)
    assert state.proc.proc.returncode == -signal.SIGKILL, state.proc.output()
    state.proc = await asyncio.to_thread(ChronoqProcess, state.proc.data_dir, config)


async def kill_9_repeatedly(state, config: str, kills: int, before_each, senders, consumers) -> int:
    """SIGKILL and restart the broker ``kills`` times (``await before_each()`` first each time),
    then stop sending, drain, and end every lane. Returns how many kills were made."""
    made = 0
    try:
        for _ in range(kills):
            await before_each()
            await kill_9_and_restart(state, config)
            made += 1
        await asyncio.sleep(0.5)
        await stop_sending_and_drain(state, senders)
        await asyncio.sleep(0.5)
    finally:
        state.sending = state.consuming = False
        await asyncio.gather(*senders, *consumers, return_exceptions=True)
    return made


async def _lane(state: State, step, running=lambda state: state.sending) -> None:
    """Run ``step(client)`` while ``running(state)``; a failure (a kill) drops the client: reconnect."""
    client = None
    while running(state):
        if client is None:
            client = Client(state.endpoint, request_timeout_s=REQUEST_TIMEOUT_S)
        try:
            await step(client)
        except ClientError as exc:  # the broker answered, and refused: never right here
            state.refused.append(str(exc))
            await asyncio.sleep(0.05)
        except Exception:  # noqa: BLE001 - the server was killed: its answer is unknown
            state.errors += 1
            await client.close()
            client = None
            await asyncio.sleep(0.05)
    if client is not None:
        await client.close()


def _plain(state: State, seq):
    async def step(client: Client) -> None:
        # Several calls in flight on one connection: the broker reads them in one go and each
        # waits for the same fsync.
        batches = [[OutgoingMessage(PLAIN, f"p{next(seq)}".encode()) for _ in range(state.rng.choice((1, 1, 3, 8)))]
                   for _ in range(state.rng.choice((1, 4)))]
        for batch, receipts in zip(batches, await asyncio.gather(*(client.send_batch(b) for b in batches))):
            for r in receipts:
                state.acked[r.message_id] = (PLAIN, 0)
    return step


def _delayed(state: State, seq):
    async def step(client: Client) -> None:
        due = int(time.time() * 1000 + state.rng.uniform(*SHORT_DELAY_S) * 1000)
        r = await client.send(DELAY, f"d{next(seq)}".encode(), deliver_at_ms=due)
        state.acked[r.message_id] = (DELAY, due)
        await asyncio.sleep(0.01)
    return step


def _recalls(state: State, seq):
    async def step(client: Client) -> None:
        due = int(time.time() * 1000 + state.rng.uniform(*RECALL_DELAY_S) * 1000)
        recall = state.rng.random() < 0.5
        r = await client.send(DELAY, f"r{next(seq)}".encode(), deliver_at_ms=due)
        if not recall:
            state.acked[r.message_id] = (DELAY, due)
        else:  # unknown until the recall is answered: neither expected nor forbidden
            await client.recall(DELAY, r.recall_handle)
            state.recalled.add(r.message_id)
        await asyncio.sleep(0.02)
    return step


def _fifo(state: State, seq):
    async def step(client: Client) -> None:
        n = next(seq)
        r = await client.send(FIFO, f"f{n}".encode(), message_group=f"g{n % FIFO_GROUPS}")
        state.acked[r.message_id] = (FIFO, 0)
    return step


async def _transactions(state: State, seq) -> None:
    """Half, then COMMIT or ROLLBACK, through the RocketMQ calls (chronoq's client has no
    transactions); reconnects after a kill like the other lanes."""
    channel = stub = None
    while state.sending:
        if stub is None:
            channel = grpc.aio.insecure_channel(state.endpoint)
            stub = service_pb2_grpc.MessagingServiceStub(channel)
        mid = "01" + uuid.uuid4().hex[:32].upper()
        sp = pb.SystemProperties(message_id=mid, message_type=pb.TRANSACTION, body_encoding=pb.IDENTITY,
                                 born_host="127.0.0.1")
        sp.born_timestamp.seconds = int(time.time())
        commit = state.rng.random() < 0.6
        try:
            res = await stub.SendMessage(sv.SendMessageRequest(messages=[pb.Message(
                topic=pb.Resource(name=TXN), body=f"t{next(seq)}".encode(), system_properties=sp)]),
                metadata=META, timeout=REQUEST_TIMEOUT_S)
            if res.status.code != pb.OK:
                state.refused.append(f"SendMessage: {res.status}")
                continue
            end = await stub.EndTransaction(sv.EndTransactionRequest(
                topic=pb.Resource(name=TXN), message_id=mid, transaction_id=res.entries[0].transaction_id,
                resolution=pb.COMMIT if commit else pb.ROLLBACK), metadata=META, timeout=REQUEST_TIMEOUT_S)
            if end.status.code != pb.OK:
                state.refused.append(f"EndTransaction: {end.status}")
                continue
            if commit:
                state.acked[mid] = (TXN, 0)
            else:
                state.rolled_back.add(mid)
        except Exception:  # noqa: BLE001 - a kill: unknown outcome
            state.errors += 1
            await channel.close()
            channel = stub = None
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.01)
    if channel is not None:
        await channel.close()


def _consume(state: State, group: str, topic: str):
    async def step(client: Client) -> None:
        got = await client.receive(group, topic, max_messages=32, invisible_s=INVISIBLE_S, wait_s=0.5)
        tally(state, got, int(time.time() * 1000))
        if got:
            try:
                await client.ack(group, topic, got)
            except ClientError:  # a receive from the broker before a kill: its handles are stale
                state.errors += 1
    return step


def _consumers(state: State) -> list[asyncio.Task]:
    pairs = [(GROUP, PLAIN), (GROUP, DELAY), (GROUP, TXN), (FIFO_GROUP, FIFO)]
    return [asyncio.create_task(_lane(state, _consume(state, g, t), lambda state: state.consuming)) for g, t in pairs]


async def _run(state: State) -> dict:
    async with AdminClient(state.endpoint) as admin:  # before the consumers ask for them
        for topic in (PLAIN, DELAY, FIFO, TXN):
            await admin.create_topic(topic)
    seqs = [iter(range(k * 10**7, (k + 1) * 10**7)) for k in range(5)]
    senders = [asyncio.create_task(_lane(state, _plain(state, seqs[0]))),
               asyncio.create_task(_lane(state, _plain(state, seqs[0]))),
               asyncio.create_task(_lane(state, _delayed(state, seqs[1]))),
               asyncio.create_task(_lane(state, _recalls(state, seqs[2]))),
               asyncio.create_task(_lane(state, _fifo(state, seqs[3]))),
               asyncio.create_task(_transactions(state, seqs[4]))]
    consumers = _consumers(state)
    kills = 0
    try:
        for _ in range(KILLS):
            await asyncio.sleep(state.rng.uniform(*KILL_GAP_S))
            await kill_9_and_restart(state, CONFIG)
            kills += 1
        await asyncio.sleep(state.rng.uniform(*KILL_GAP_S))  # the last process takes load too
        await stop_sending_and_drain(state, senders)
        await asyncio.sleep(1.0)  # anything forbidden that would still come, comes now
    finally:
        state.sending = state.consuming = False
        await asyncio.gather(*senders, *consumers, return_exceptions=True)
    return {"kills": kills}


async def _receive_again(state: State) -> int:
    """After a clean restart: how many acknowledged messages come again (acks were durable: none)."""
    again = 0
    async with Client(state.endpoint, request_timeout_s=REQUEST_TIMEOUT_S) as client:
        for group, topic in ((GROUP, PLAIN), (GROUP, DELAY), (GROUP, TXN), (FIFO_GROUP, FIFO)):
            got = await client.receive(group, topic, max_messages=32, invisible_s=INVISIBLE_S, wait_s=0.5)
            again += len(got)
    return again


def _audit(data_dir: str, config_path: str) -> dict[str, str]:
    """message id -> topic, for every message in the four topics' consume queues."""
    cfg = load_config(config_path, env={}, overrides={"data_dir": data_dir})
    broker = Broker(cfg)
    found: dict[str, str] = {}
    try:
        for topic in (PLAIN, DELAY, FIFO, TXN):
            if topic not in broker.topics:
                continue
            for qid in range(broker.topics[topic].queues):
                offset = 0
                for _ in range(10_000):
                    got = broker.read(topic, qid, offset, 1000)
                    for m in got.messages:
                        found[m.message_id] = topic
                    if not got.messages or got.next_offset >= got.max_offset:
                        break
                    offset = got.next_offset
    finally:
        broker.close()
    return found


def _queues(data_dir: str) -> dict[tuple[str, int], tuple]:
    """Every consume queue of the store at ``data_dir``: (bounds, entries)."""
    store = Store(data_dir)
    try:
        out = {}
        for key in sorted(store.queues):
            lo, hi = store.bounds(*key)
            out[key] = ((lo, hi), store.entries(key[0], key[1], lo, hi - lo))
        return out
    finally:
        store.close()


@pytest.mark.timeout(180)  # ~30 s on a quiet machine
def test_kill_9_under_mixed_load_keeps_every_acknowledged_change(tmp_path):
    print(f"\ncommitter crash test seed {SEED} (CHRONOQ_COMMITTER_CRASH_SEED), {KILLS} kills")
    data_dir = str(tmp_path / "data")
    config_path = str(tmp_path / "data.toml")
    state = State(ChronoqProcess(data_dir, CONFIG), random.Random(SEED))
    try:
        summary = asyncio.run(_run(state))
        ctx = f"seed {SEED}"
        kinds = {t: sum(1 for topic, _ in state.acked.values() if topic == t) for t in (PLAIN, DELAY, FIFO, TXN)}
        assert not state.refused, f"{ctx}: {len(state.refused)} valid requests refused: {state.refused[:3]}"
        assert all(kinds.values()) and state.recalled and state.rolled_back, f"{ctx}: a lane never got through: {kinds}"
        missing = set(state.acked) - set(state.received)
        assert not missing, f"{ctx}: {len(missing)} acknowledged sends never received, e.g. " \
                            f"{[(m, state.acked[m]) for m in sorted(missing)[:5]]}"
        assert not state.early, f"{ctx}: {len(state.early)} delivered early: {state.early[:5]}"
        forbidden = (state.recalled | state.rolled_back) & set(state.received)
        assert not forbidden, f"{ctx}: recalled or rolled back, yet delivered: {sorted(forbidden)[:5]}"
        state.proc.stop()  # cleanly, after all that
        state.proc = ChronoqProcess(data_dir, CONFIG)
        again = asyncio.run(_receive_again(state))
        assert again == 0, f"{ctx}: {again} acknowledged messages came back after a clean restart"
        state.proc.stop()
        found = _audit(data_dir, config_path)
        lost = {m for m, (topic, _) in state.acked.items() if found.get(m) != topic}
        assert not lost, f"{ctx}: {len(lost)} acknowledged sends are not in their topic: {sorted(lost)[:5]}"
        stored_forbidden = (state.recalled | state.rolled_back) & set(found)
        assert not stored_forbidden, f"{ctx}: recalled or rolled back, yet in a topic: {sorted(stored_forbidden)[:5]}"
        rebuilt_dir = str(tmp_path / "rebuilt")
        shutil.copytree(data_dir, rebuilt_dir, ignore=shutil.ignore_patterns("*.lock", "lock"))
        shutil.rmtree(os.path.join(rebuilt_dir, "consumequeue"))
        os.unlink(os.path.join(rebuilt_dir, "checkpoint.json"))
        live, rebuilt = _queues(data_dir), _queues(rebuilt_dir)
        assert live.keys() == rebuilt.keys(), f"{ctx}: queues differ: {sorted(live.keys() ^ rebuilt.keys())}"
        differ = [k for k in live if live[k] != rebuilt[k]]
        assert not differ, f"{ctx}: consume queues differ from a rebuild from the log: {differ[:5]}"
        summary.update(acked=kinds, recalled=len(state.recalled), rolled_back=len(state.rolled_back),
                       received=len(state.received), redelivered=sum(n - 1 for n in state.received.values()),
                       errors=state.errors, queues=len(live))
        print(f"committer crash test result: {summary}")
    finally:
        if state.proc.proc.returncode is None:
            state.proc.stop(check=False)
