"""Access control, TLS and limits, with the unmodified official Python client (5.1.2) where it applies.

Each scenario runs against a real ``chronoq serve`` subprocess. The official client reports a
refused route lookup only in its own log (contract §4.2: "For QueryRoute at startup this is only
logged, and sends fail later with 'failed to fetch topic route'"), so the tests capture the
``rocketmq-python-client`` logger to see the code and message the broker answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from contextlib import contextmanager

import grpc
import pytest
from rocketmq import (ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer)
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, ClientError, OutgoingMessage
from chronoq.protocol.rocketmq.ack import ack_and_receive_request

from .conftest import ROOT, ChronoqProcess, wait_until

USERS = {
    "app": "app-secret-0b7e",       # orders*: publish and subscribe, billing* groups
    "reader": "reader-secret-91c2",  # reports*: subscribe only, audit* groups
    "writer": "writer-secret-7a4f",  # orders*: publish only, billing* groups
    "root": "root-secret-5d03",      # admin
}
AUTH_TOML = textwrap.dedent(f"""
    log_level = "debug"
    [auth]
    enabled = true
    [[auth.users]]
    access_key = "app"
    secret_key = "{USERS['app']}"
    publish = ["orders*"]
    subscribe = ["orders*"]
    groups = ["billing*"]
    [[auth.users]]
    access_key = "reader"
    secret_key_env = "CHRONOQ_TEST_READER_SECRET"
    subscribe = ["reports*"]
    groups = ["audit*"]
    [[auth.users]]
    access_key = "writer"
    secret_key = "{USERS['writer']}"
    publish = ["orders*"]
    groups = ["billing*"]
    [[auth.users]]
    access_key = "root"
    secret_key = "{USERS['root']}"
    admin = true
""")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    os.environ["CHRONOQ_TEST_READER_SECRET"] = USERS["reader"]  # secret_key_env, read by the server
    try:
        proc = ChronoqProcess(str(tmp_path_factory.mktemp("auth") / "data"), AUTH_TOML)
    finally:
        os.environ.pop("CHRONOQ_TEST_READER_SECRET", None)
    try:
        yield proc
    finally:
        proc.stop()


class ClientLog(logging.Handler):
    """Collects what the official client logs (it logs refused route lookups with code and message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def wait_for(self, fragment: str, timeout_s: float = 5.0) -> str:
        return wait_until(lambda: next((line for line in self.lines if fragment in line), None), timeout_s,
                          what=f"client log line with {fragment!r}")


@pytest.fixture
def client_log():
    handler = ClientLog()
    logger = logging.getLogger("rocketmq-python-client")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def config(endpoint: str, ak: str, sk: str) -> ClientConfiguration:
    return ClientConfiguration(endpoint, Credentials(ak, sk), request_timeout=3)


def message(topic: str, body: bytes) -> Message:
    m = Message()
    m.topic = topic
    m.body = body
    return m


@contextmanager
def producer(endpoint: str, ak: str, sk: str, topic: str, **kwargs):
    p = Producer(config(endpoint, ak, sk), (topic,), **kwargs)
    p.startup()
    try:
        yield p
    finally:
        p.shutdown()


@contextmanager
def consumer(endpoint: str, ak: str, sk: str, group: str, topic: str, await_s: int = 1, **kwargs):
    c = SimpleConsumer(config(endpoint, ak, sk), group, {topic: FilterExpression("*")}, await_duration=await_s,
                       **kwargs)
    c.startup()
    try:
        yield c
    finally:
        c.shutdown()


def code_of(exc: BaseException) -> int | None:
    return getattr(exc, "code", None)


# ------------------------------------------------------------------------------ authentication
def test_right_credentials_send_and_receive(auth_server):
    topic = unique("orders")
    with producer(auth_server.endpoint, "app", USERS["app"], topic) as p:
        receipt = p.send(message(topic, b"signed"))
    with consumer(auth_server.endpoint, "app", USERS["app"], unique("billing"), topic) as c:
        got = wait_until(lambda: c.receive(16, 30), 15, what="the message")
        assert [m.body for m in got] == [b"signed"] and got[0].message_id == receipt.message_id
        c.ack(got[0])


@pytest.mark.parametrize("ak, sk, fragment", [
    ("app", "not-the-secret", "signature mismatch for access key 'app'"),
    ("mallory", "whatever", "unknown access key 'mallory'"),
    ("", "", "authentication required"),
], ids=["wrong-secret", "unknown-key", "no-credentials"])
def test_bad_credentials_are_refused_unauthorized(auth_server, client_log, ak, sk, fragment):
    topic = unique("orders")
    with producer(auth_server.endpoint, ak, sk, topic) as p:
        with pytest.raises(Exception) as info:
            p.send(message(topic, b"never stored"))
        assert "route" in str(info.value)  # the official client's wording for a refused route
    line = client_log.wait_for(fragment)
    assert "40100" in line  # UNAUTHORIZED in the response status, not a gRPC error
    # The same refusal, seen directly: the send itself (not just the route) is UNAUTHORIZED.
    async def direct():
        async with Client(auth_server.endpoint, access_key=ak, secret_key=sk) as client:
            with pytest.raises(ClientError) as refused:
                await client.send_batch([OutgoingMessage(topic, b"never stored")])
            return refused.value

    refused = asyncio.run(direct())
    assert refused.code == pb.Code.UNAUTHORIZED and fragment in refused.status_message
    # Nothing was stored: the admin sees no such topic.
    topics = asyncio.run(_admin_call(auth_server.endpoint, "root", USERS["root"], "list_topics"))
    assert topic not in {t.name for t in topics}


def test_streaming_calls_answer_unauthorized_in_their_status_message(auth_server):
    async def scenario():
        async with grpc.aio.insecure_channel(auth_server.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            md = (("x-mq-client-id", "intruder"),)
            replies = [r async for r in stub.ReceiveMessage(sv.ReceiveMessageRequest(), metadata=md)]
            assert [r.status.code for r in replies] == [pb.Code.UNAUTHORIZED]
            call = stub.Telemetry(metadata=md)
            reply = await call.read()
            assert reply.status.code == pb.Code.UNAUTHORIZED and "authentication required" in reply.status.message
            assert await call.read() == grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK  # answered in the body, never a gRPC error

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ authorization
def test_missing_publish_permission_is_forbidden(auth_server):
    topic = unique("reports")  # reader may subscribe (so the route resolves) but not publish
    with producer(auth_server.endpoint, "reader", USERS["reader"], topic) as p:
        with pytest.raises(Exception) as info:
            p.send(message(topic, b"not allowed"))
    assert type(info.value).__name__ == "ForbiddenException" and code_of(info.value) == pb.Code.FORBIDDEN
    assert f"may not publish to topic '{topic}'" in str(info.value)


def test_missing_group_or_subscribe_permission_is_forbidden(auth_server):
    topic = unique("orders")
    with consumer(auth_server.endpoint, "app", USERS["app"], unique("fraud"), topic) as c:
        with pytest.raises(Exception) as info:
            c.receive(16, 30)
    assert type(info.value).__name__ == "ForbiddenException" and code_of(info.value) == pb.Code.FORBIDDEN
    assert "may not use consumer group 'fraud-" in str(info.value)
    # writer may publish to the topic (so its route resolves) but not subscribe to it.
    with consumer(auth_server.endpoint, "writer", USERS["writer"], unique("billing"), topic) as c:
        with pytest.raises(Exception) as info:
            c.receive(16, 30)
    assert type(info.value).__name__ == "ForbiddenException" and code_of(info.value) == pb.Code.FORBIDDEN
    assert f"may not subscribe to topic '{topic}'" in str(info.value)


def test_chronoq_client_receives_refused_by_the_gate_answer_forbidden(auth_server):
    """ReceiveBatch and AckAndReceive (chronoq.client's receive calls) write their one answer
    through the context; a refused one writes the gate's status instead: FORBIDDEN, saying why,
    with no message handed out."""
    topic = unique("orders")

    async def go():
        group = unique("billing")
        async with Client(auth_server.endpoint, access_key="app", secret_key=USERS["app"]) as app, \
                Client(auth_server.endpoint, access_key="writer", secret_key=USERS["writer"]) as writer:
            await app.send_batch([OutgoingMessage(topic, b"kept for billing")])
            with pytest.raises(ClientError) as refused:  # writer may publish to orders*, not subscribe
                await writer.receive(group, topic, max_messages=1, wait_s=0)
            assert refused.value.code == pb.Code.FORBIDDEN
            assert f"may not subscribe to topic '{topic}'" in refused.value.status_message
            got = await app.receive(group, topic, max_messages=1, wait_s=5)
            assert [m.body for m in got] == [b"kept for billing"]  # (not handed out to the refused)
            # AckAndReceive of app's message by writer: refused whole, the ack not made.
            request = await writer._receive_request(group, topic, 1, 30, 0, "*")
            both = ack_and_receive_request(writer._ack_request(group, topic, got), request.SerializeToString())
            with pytest.raises(ClientError) as refused_both:
                await writer._chronoq_call(writer._ack_and_receive, both, 5)
            assert refused_both.value.code == pb.Code.FORBIDDEN
            await app.ack(group, topic, got)  # still app's to settle

    asyncio.run(go())


async def _admin_call(endpoint: str, ak: str, sk: str, method: str, *args):
    async with AdminClient(endpoint, access_key=ak, secret_key=sk) as admin:
        return await getattr(admin, method)(*args)


def _cli(endpoint: str, *args: str, ak: str | None = None, sk: str | None = None, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHRONOQ_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CHRONOQ_ENDPOINT=endpoint)
    if ak is not None:
        env.update(CHRONOQ_ACCESS_KEY=ak, CHRONOQ_SECRET_KEY=sk or "")
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=30)


def test_admin_calls_need_the_admin_role(auth_server):
    name = unique("orders")
    with pytest.raises(ClientError) as info:
        asyncio.run(_admin_call(auth_server.endpoint, "app", USERS["app"], "create_topic", name))
    assert info.value.code == pb.Code.FORBIDDEN and "needs the admin role" in info.value.status_message
    with pytest.raises(ClientError) as info:
        asyncio.run(_admin_call(auth_server.endpoint, "app", "wrong", "list_topics"))
    assert info.value.code == pb.Code.UNAUTHORIZED
    created = asyncio.run(_admin_call(auth_server.endpoint, "root", USERS["root"], "create_topic", name))
    assert created.name == name
    # The CLI: credentials from CHRONOQ_ACCESS_KEY / CHRONOQ_SECRET_KEY; exit 1 names the code.
    refused = _cli(auth_server.endpoint, "topic", "create", unique("orders"), ak="app", sk=USERS["app"])
    assert refused.returncode == 1 and "FORBIDDEN" in refused.stderr and "admin role" in refused.stderr
    anonymous = _cli(auth_server.endpoint, "topic", "list")
    assert anonymous.returncode == 1 and "UNAUTHORIZED" in anonymous.stderr
    listed = _cli(auth_server.endpoint, "topic", "list", "--json", ak="root", sk=USERS["root"])
    assert listed.returncode == 0, listed.stderr
    assert name in {t["name"] for t in json.loads(listed.stdout)}
    # Flags work too (the env is preferred: a flag shows in the process list).
    sent = _cli(auth_server.endpoint, "send", name, "via-cli", "--access-key", "root", "--secret-key", USERS["root"])
    assert sent.returncode == 0, sent.stderr
    # Message lookup (chronoq message show) shows ids and keys of every topic: admins only.
    looked = _cli(auth_server.endpoint, "message", "show", "some-key", ak="app", sk=USERS["app"])
    assert looked.returncode == 1 and "FORBIDDEN" in looked.stderr
    looked = _cli(auth_server.endpoint, "message", "show", "some-key", ak="root", sk=USERS["root"])
    assert looked.returncode == 4 and "not found" in looked.stderr


def test_secrets_and_signatures_never_reach_the_broker_log(auth_server):
    # Make sure the log has seen good and bad credentials of every user (it runs at debug level).
    topic = unique("orders")
    for ak, sk in [("app", USERS["app"]), ("app", "bad-guess-secret"), ("root", USERS["root"])]:
        async def send():
            async with Client(auth_server.endpoint, access_key=ak, secret_key=sk) as client:
                try:
                    await client.send(topic, b"x")
                except ClientError:
                    pass
        asyncio.run(send())
    log_text = "\n".join(auth_server.lines) + open(auth_server.stderr_path, errors="replace").read()
    assert "DEBUG" in log_text  # the broker really logged at debug level
    for secret in [*USERS.values(), "bad-guess-secret"]:
        assert secret not in log_text
    assert "Signature=" not in log_text and "MQv2-HMAC-SHA1 Credential" not in log_text


# ------------------------------------------------------------------------------ TLS
def _make_certificates(directory) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = str(directory)

    def run(*args):
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=chronoq test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    with open(os.path.join(d, "ext.cnf"), "w") as fh:
        fh.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return (os.path.join(d, "ca.pem"), os.path.join(d, "server.pem"), os.path.join(d, "server.key"))


OFFICIAL_TLS_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer
    endpoint, topic, group, ak, sk = sys.argv[1:6]
    cfg = ClientConfiguration(endpoint, Credentials(ak, sk), request_timeout=5)
    p = Producer(cfg, (topic,), tls_enable=True)
    p.startup()
    m = Message(); m.topic = topic; m.body = b"over tls"
    receipt = p.send(m)
    p.shutdown()
    c = SimpleConsumer(cfg, group, {topic: FilterExpression("*")}, await_duration=2, tls_enable=True)
    c.startup()
    got, deadline = [], time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got = c.receive(16, 30)
    for msg in got:
        c.ack(msg)
    c.shutdown()
    print(json.dumps({"sent": receipt.message_id, "received": [[g.message_id, g.body.decode()] for g in got]}))
""")


def test_official_python_client_connects_over_tls(tmp_path):
    ca, cert, key = _make_certificates(tmp_path)
    server = ChronoqProcess(str(tmp_path / "data"), textwrap.dedent(f"""
        tls_cert_file = "{cert}"
        tls_key_file = "{key}"
        [auth]
        enabled = true
        [[auth.users]]
        access_key = "app"
        secret_key = "{USERS['app']}"
        publish = ["orders*"]
        subscribe = ["orders*"]
        groups = ["billing*"]
    """))
    try:
        topic, group = unique("orders"), unique("billing")
        # The official client takes no CA of its own: gRPC's environment variable points it at ours.
        env = dict(os.environ, GRPC_DEFAULT_SSL_ROOTS_FILE_PATH=ca)
        proc = subprocess.run([sys.executable, "-c", OFFICIAL_TLS_SCRIPT, server.endpoint, topic, group, "app",
                               USERS["app"]], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["received"] == [[result["sent"], "over tls"]]

        async def plaintext():  # the TLS port refuses a plaintext client (transport error)
            async with Client(server.endpoint, access_key="app", secret_key=USERS["app"],
                              request_timeout_s=2) as client:
                await client.send(topic, b"plain")

        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(plaintext())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # chronoq's own CLI over TLS with a custom CA.
        sent = _cli(server.endpoint, "send", topic, "cli over tls", "--tls-ca-file", ca, ak="app",
                    sk=USERS["app"])
        assert sent.returncode == 0, sent.stderr
    finally:
        server.stop()


# ------------------------------------------------------------------------------ limits
LIMITS_TOML = textwrap.dedent("""
    max_body_bytes = 1024
    max_parked_polls = 2
    max_streams_per_client = 2
""")


@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    proc = ChronoqProcess(str(tmp_path_factory.mktemp("limits") / "data"), LIMITS_TOML)
    try:
        yield proc
    finally:
        proc.stop()


def test_oversize_body_is_refused(limits_server):
    topic = unique("big")
    with producer(limits_server.endpoint, "", "", topic) as p:
        with pytest.raises(Exception) as info:
            p.send(message(topic, b"x" * 2000))
        assert "1024" in str(info.value) or "too large" in str(info.value).lower()
        p.send(message(topic, b"x" * 1024))  # at the limit: fine

    async def direct():
        async with Client(limits_server.endpoint) as client:
            with pytest.raises(ClientError) as refused:
                await client.send(topic, b"y" * 1025)
            return refused.value

    refused = asyncio.run(direct())
    assert refused.code == pb.Code.MESSAGE_BODY_TOO_LARGE and "limit is 1024" in refused.status_message


def test_batch_limits(limits_server):
    topic = unique("batch")

    async def scenario():
        async with Client(limits_server.endpoint) as client:
            with pytest.raises(ClientError) as refused:
                await client.send_batch([OutgoingMessage(topic, b"m") for _ in range(1025)])
            assert refused.value.code == pb.Code.BAD_REQUEST and "at most 1024" in refused.value.status_message
            await client.send_batch([OutgoingMessage(topic, b"m%d" % i) for i in range(40)])
            got = await client.receive(unique("g"), topic, max_messages=1000, wait_s=1)  # asks for 1000
            assert 0 < len(got) <= 32  # served at most a receive batch

    asyncio.run(scenario())


def test_too_many_parked_polls_answer_too_many_requests(limits_server):
    topic = unique("parked")
    with producer(limits_server.endpoint, "", "", topic) as p:
        p.send(message(topic, b"create the topic"))
    group = unique("g")
    with consumer(limits_server.endpoint, "", "", group, topic) as first:
        assert first.receive(16, 30)  # drain: from now on receives park
    consumers = [SimpleConsumer(config(limits_server.endpoint, "", ""), unique("g"), {topic: FilterExpression("*")},
                                await_duration=8) for _ in range(3)]
    for c in consumers:
        c.startup()
    results: dict[int, object] = {}

    def park(i: int) -> None:
        try:
            results[i] = consumers[i].receive(16, 30)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            results[i] = exc

    try:
        # Each new group starts at the queue head, so drain the one message first, then park.
        for c in consumers:
            wait_until(lambda c=c: c.receive(16, 30), 15, what="the first message")
        threads = [threading.Thread(target=park, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # let both park before the third asks (else the third might take a place)
        # Once two are parked the next long poll is refused at once. (Should the third have
        # parked first after all, one of the others is the refused one: either way, never three.)
        deadline = time.monotonic() + 20
        refusal = None
        while refusal is None and time.monotonic() < deadline:
            started = time.monotonic()
            try:
                consumers[2].receive(16, 30)
            except Exception as exc:  # noqa: BLE001
                refusal = exc
                assert time.monotonic() - started < 3  # refused, not parked
            refusal = refusal or next((r for r in results.values() if isinstance(r, Exception)), None)
        assert refusal is not None, "no long poll was ever refused"
        assert type(refusal).__name__ == "TooManyRequestsException" and code_of(refusal) == pb.Code.TOO_MANY_REQUESTS
        assert "max_parked_polls" in str(refusal)
        with producer(limits_server.endpoint, "", "", topic) as p:  # wakes the parked ones
            p.send(message(topic, b"wake up"))
        for t in threads:
            t.join(20)
        for r in results.values():
            assert not isinstance(r, Exception) or type(r).__name__ == "TooManyRequestsException", r
    finally:
        for c in consumers:
            c.shutdown()


def test_telemetry_streams_per_client_are_limited(limits_server):
    async def scenario():
        async with grpc.aio.insecure_channel(limits_server.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            settings = sv.TelemetryCommand(settings=pb.Settings(
                client_type=pb.PRODUCER, publishing=pb.Publishing(topics=[pb.Resource(name="t")])))

            async def open_stream(client_id: str):
                call = stub.Telemetry(metadata=(("x-mq-client-id", client_id),))
                try:
                    await call.write(settings)
                except grpc.aio.AioRpcError:  # a refused stream may be closed before our write lands
                    pass
                return call, await asyncio.wait_for(call.read(), 5)

            kept = []
            for _ in range(2):
                call, reply = await open_stream("greedy")
                assert reply.status.code == pb.Code.OK
                kept.append(call)
            call, reply = await open_stream("greedy")
            assert reply.status.code == pb.Code.TOO_MANY_REQUESTS and "max_streams_per_client" in reply.status.message
            assert await call.read() == grpc.aio.EOF
            other, reply = await open_stream("modest")  # other clients are not affected
            assert reply.status.code == pb.Code.OK
            kept.append(other)
            await kept[0].done_writing()  # one closes: the greedy client may open another
            assert await kept[0].read() == grpc.aio.EOF
            for _ in range(100):
                call, reply = await open_stream("greedy")
                if reply.status.code == pb.Code.OK:
                    break
                await asyncio.sleep(0.05)
            assert reply.status.code == pb.Code.OK
            kept.append(call)
            for c in kept:
                c.cancel()

    asyncio.run(scenario())


def test_a_client_id_is_each_users_own(tmp_path, request):
    """Another user naming a client's id used to reach that client's state: its
    NotifyClientTermination ended the victim's auto-renewals (the victim's in-flight message went
    to a second consumer a second later, while the victim still worked on it and heartbeated), and
    a Telemetry stream under the id took the victim's session (its transaction checks). With
    access control on, a client id names the signed-in user's own client only."""
    from chronoq.core import acl

    topic, group = unique("orders-renew"), unique("billing-renew")
    os.environ["CHRONOQ_TEST_READER_SECRET"] = USERS["reader"]
    try:  # push receives invisible in slices of 1 s: an auto-renewal not made shows at once
        auth_server = ChronoqProcess(str(tmp_path / "data"), "push_invisible_ms = 1000\n" + AUTH_TOML)
    finally:
        os.environ.pop("CHRONOQ_TEST_READER_SECRET", None)
    request.addfinalizer(lambda: auth_server.stop(check=False))

    def md(user: str, client: str):
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return (("x-mq-client-id", client), ("x-mq-date-time", date), ("x-mq-language", "PYTHON"),
                ("authorization", acl.authorization_header(user, USERS[user], date)))

    with grpc.insecure_channel(auth_server.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        with producer(auth_server.endpoint, "app", USERS["app"], topic) as p:
            p.send(message(topic, b"work item"))

        def receive(client: str, auto_renew: bool) -> list[bytes]:
            req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                           message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=-1),
                                           batch_size=16, auto_renew=auto_renew)
            if not auto_renew:
                req.invisible_duration.FromSeconds(30)
            req.long_polling_timeout.FromSeconds(1)
            return [r.message.body for r in stub.ReceiveMessage(req, metadata=md("app", client), timeout=10)
                    if r.HasField("message")]

        assert receive("victim@1", auto_renew=True) == [b"work item"]  # in flight, renewed while it lives
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            stub.Heartbeat(sv.HeartbeatRequest(group=pb.Resource(name=group), client_type=pb.PUSH_CONSUMER),
                           metadata=md("app", "victim@1"), timeout=5)  # the victim is alive ...
            ended = stub.NotifyClientTermination(  # ... and another user says it ended
                sv.NotifyClientTerminationRequest(group=pb.Resource(name=group)), metadata=md("writer", "victim@1"),
                timeout=5)
            assert ended.status.code == pb.Code.OK  # (it names only the writer's own client of that id)
            assert receive("second@2", auto_renew=False) == [], "the victim's message was handed out again"
