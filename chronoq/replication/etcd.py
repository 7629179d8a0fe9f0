"""The one module that talks to etcd (``aetcd``: etcd's v3 gRPC API over grpc.aio).

How it is reached (``EtcdAccess``): its endpoints, tried in turn; TLS when a CA or a client
certificate is configured (etcd's ``--cert-file``/``--trusted-ca-file``, and ``--client-cert-auth``
for the client certificate; aetcd speaks plaintext only, so ``_tls_client_class`` opens its channel with the
credentials); a user and password when etcd's authentication is on (aetcd asks etcd for a token
at connect; the keep-alive loop uses it once a period so etcd does not forget it, and a refused
one drops the connection: the next connect asks for a new token).

``EtcdCoordinator`` runs on a thread of its own with its own (standard asyncio) event loop: the
lease's keep-alives must go out on time however busy the broker's loop is, and whatever that
loop's implementation (uvloop). The broker's loop calls the coroutines below through ``call``
(they run on the coordinator's loop); the lease deadline (``coordinator.LeaseDeadline``) is
read from any thread (a few attributes under the GIL).

Keys and values: ``chronoq.replication.coordinator``. One lease per process, granted at start:
the member key always hangs on it, and the leader key once this node wins a campaign. A
follower whose lease expired (a long pause) is granted a new one; a leader's lease that expired
is final (``LeaseDeadline.lose``): that broker is fenced for the rest of its life, and steps down
(``fresh_lease``: the old lease revoked, a new one with a new deadline for the node's next role).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from dataclasses import dataclass, field

from chronoq.core import errors
from chronoq.replication import coordinator as co

log = logging.getLogger("chronoq.replication.etcd")

CONNECT_TIMEOUT_S = 5.0
# A keep-alive every third of the TTL. The leader's deadline is a TTL minus a margin after the last
# one answered, so one that times out (after a period) leaves less than a period: it is retried at
# once, not a period later (with lease_ttl_ms = 2000 a single slow answer lost the leadership).
KEEPALIVES_PER_TTL = 3
RETRY_PAUSE_S = 0.02  # between a keep-alive that failed after a normal tick and its retry (on the next endpoint)


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd: endpoints, TLS material (PEM bytes, read once at start) and a user."""

    endpoints: tuple[str, ...]
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = field(default=b"", repr=False)
    user: str = ""
    password: str = field(default="", repr=False)

    @classmethod
    def of(cls, endpoints, ca_file: str = "", cert_file: str = "", key_file: str = "", user: str = "",
           password: str = "") -> "EtcdAccess":
        """From settings (``BrokerConfig.etcd_access``, the CLI's --etcd options): the files read
        now, so a missing or unreadable one is refused at start, naming it."""
        if bool(cert_file) != bool(key_file):
            raise errors.ClientError("etcd_cert_file and etcd_key_file go together (a client certificate and its key)")
        if bool(user) != bool(password):
            raise errors.ClientError("etcd_user and etcd_password go together")
        return cls(tuple(endpoints), _read_pem(ca_file, "etcd_ca_file"), _read_pem(cert_file, "etcd_cert_file"),
                   _read_pem(key_file, "etcd_key_file"), user, password)

    @classmethod
    def coerce(cls, access) -> "EtcdAccess":
        """``access`` itself, or plain endpoints (a list of host:port) reached without TLS or a user."""
        return access if isinstance(access, EtcdAccess) else cls(tuple(access))

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def client(self, endpoint: str, timeout: float):
        """An aetcd client of ``endpoint`` (not connected yet)."""
        import aetcd

        host, _, port = endpoint.rpartition(":")
        settings = dict(host=host, port=int(port), timeout=timeout)
        if self.user:
            settings.update(username=self.user, password=self.password)
        if not self.tls:
            return aetcd.Client(**settings)
        import grpc

        credentials = grpc.ssl_channel_credentials(self.ca or None, self.key or None, self.cert or None)
        return _tls_client_class()(credentials, **settings)


def _read_pem(path: str, setting: str) -> bytes:
    if not path:
        return b""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise errors.ClientError(f"{setting} {path!r} cannot be read: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise errors.ClientError(f"{setting} {path!r} is not PEM (no -----BEGIN line)")
    return data


@functools.cache
def _tls_client_class():
    """aetcd's client with a TLS channel: aetcd opens plaintext channels only. Its ``connect``
    made over: the same stubs and watcher on a secure channel, the token asked for first."""
    import aetcd
    import grpc
    from aetcd import rpc, watcher

    class TlsClient(aetcd.Client):
        def __init__(self, credentials, **settings) -> None:
            super().__init__(**settings)
            self._credentials = credentials

        async def connect(self) -> None:
            if self._connected.is_set():
                return
            channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                              options=list(self._options.items()))
            try:
                metadata = None
                if self._username is not None:
                    answer = await rpc.AuthStub(channel).Authenticate(
                        rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                    metadata = (("token", answer.token),)
            except grpc.aio.AioRpcError as exc:
                await channel.close()
                raise _translated(exc) from None
            except BaseException:
                await channel.close()
                raise
            self.channel, self.metadata = channel, metadata
            self.auth_stub = rpc.AuthStub(channel)
            self.kvstub, self.clusterstub = rpc.KVStub(channel), rpc.ClusterStub(channel)
            self.leasestub, self.maintenancestub = rpc.LeaseStub(channel), rpc.MaintenanceStub(channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
            self._connected.set()

    return TlsClient


def _translated(exc):
    """An AioRpcError of a connect as aetcd's own exception of that code (what its plaintext
    client raises), so both clients fail alike."""
    from aetcd import exceptions

    try:
        return exceptions._EXCEPTIONS_BY_CODE[exc.code()](exc.details())  # noqa: SLF001
    except (AttributeError, KeyError, TypeError):
        return exc


class EtcdCoordinator:
    def __init__(self, access, cluster: str, group: str, ttl_ms: int, node: str, node_id: str,
                 clock) -> None:
        self.access = access = EtcdAccess.coerce(access)
        assert access.endpoints
        self.endpoints = list(access.endpoints)
        self.cluster, self.group = cluster, group
        self.node, self.node_id = node, node_id
        self.clock = clock
        self.ttl_s = co.lease_seconds(ttl_ms)
        self.deadline = co.LeaseDeadline(clock, self.ttl_s * 1000)
        self.lease_id = 0
        self.leader: co.Leader | None = None  # this node's leader value once it won
        self.member: bytes | None = None      # this node's member value (re-put with a new lease)
        self._index = 0
        self._client = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._keepalive: asyncio.Task | None = None
        self.keys = (co.leader_key(cluster, group), co.epoch_key(cluster, group), co.insync_key(cluster, group),
                     co.member_key(cluster, group, node), co.members_prefix(cluster, group))

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the thread, connect and take a lease; ``errors.ClientError`` naming the endpoints
        when no etcd answers within ``CONNECT_TIMEOUT_S`` (each)."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="chronoq-etcd", daemon=True)
        self._thread.start()
        ready.wait()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        except BaseException:
            self.close()
            raise

    async def call(self, coro):
        """Run ``coro`` (one of this object's coroutines) on the coordinator's loop; await it here.

        A call whose gRPC channel is closed under it (the keep-alive drops a failed connection) ends
        cancelled on that loop; it is raised here as ``ConnectionError``, never as a cancellation of
        the caller's task: a replica's leader watch or a console page would otherwise end as if it had
        been stopped (the watch then never campaigned; the page's connection was dropped unanswered)."""
        done = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller itself was cancelled (wrap_future cancelled the call too)
            raise ConnectionError("the etcd call was cut off (its connection was dropped)") from None

    def close(self) -> None:
        """Revoke the lease (a leader's key goes at once: a clean stop hands over without waiting
        for the TTL; call it only once this node acknowledges nothing more) and stop the thread."""
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(CONNECT_TIMEOUT_S + 1)
        except Exception as exc:  # noqa: BLE001 - the lease then expires on its own
            log.warning("closing the etcd session failed (the lease expires on its own): %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None

    # ------------------------------------------------------------------ on the coordinator's loop
    async def _start(self) -> None:
        failures = []
        for _ in range(len(self.endpoints)):
            try:
                await asyncio.wait_for(self._connect(), CONNECT_TIMEOUT_S)
                await asyncio.wait_for(self._grant(), CONNECT_TIMEOUT_S)
                break
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - try the next endpoint
                failures.append(f"{self.endpoints[self._index]}: {_why(exc)}")
                await self._drop()
                self._index = (self._index + 1) % len(self.endpoints)
        else:
            raise errors.ClientError(
                f"etcd cannot be reached ({'; '.join(failures)}): etcd_endpoints is set, so this node takes its "
                "role from etcd and does not start without it (start etcd, or fix etcd_endpoints)")
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive(), name="chronoq-etcd-keepalive")

    async def _connect(self) -> None:
        self._client = self.access.client(self.endpoints[self._index], max(0.5, self.ttl_s / KEEPALIVES_PER_TTL))
        await self._client.connect()

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    async def _grant(self) -> None:
        sent = self.clock.monotonic_ns()
        lease = await self._client.lease(self.ttl_s)
        self.lease_id = lease.id
        if self.leader is None:  # (a leader's lost lease stays lost)
            self.deadline.deadline_ns = 0
            self.deadline.renewed(sent, lease.ttl)
        if self.member is not None:
            await self._client.put(self.keys[3], self.member, lease=self.lease_id)

    async def _keep_alive(self) -> None:
        period = self.ttl_s / KEEPALIVES_PER_TTL
        pause = period
        while True:
            await asyncio.sleep(pause)
            # After a failure one quick retry, then a period again (an etcd that is down is not
            # hammered; its warnings stay a few per second).
            pause = RETRY_PAUSE_S if pause == period else period
            sent = self.clock.monotonic_ns()
            try:
                if self._client is None:
                    await self._connect()
                reply = await asyncio.wait_for(self._client.refresh_lease(self.lease_id), period)
                if self.access.user:
                    # etcd forgets a token unused for its --auth-token-ttl, and a keep-alive does not
                    # use it: one read a period keeps it alive; a token refused all the same fails
                    # here, and the connection is made again (asking for a new one).
                    await asyncio.wait_for(self._client.get(self.keys[0]), period)
            except Exception as exc:  # noqa: BLE001 - try again (another endpoint); the deadline runs on
                log.warning("etcd keep-alive failed (%s: %s); %d ms of lease left", type(exc).__name__, exc,
                            self.deadline.remaining_ms())
                await self._drop()
                self._index = (self._index + 1) % len(self.endpoints)
                continue
            if reply is not None and reply.TTL > 0:
                self.deadline.renewed(sent, reply.TTL)
                pause = period
                continue
            if self.leader is not None:
                self.deadline.lose(f"its etcd lease expired (epoch {self.leader.epoch})")
                log.error("this node lost leadership of %s/%s: its etcd lease expired", self.cluster, self.group)
                return
            log.warning("the etcd lease expired (a pause longer than its TTL?): taking a new one")
            try:
                await self._grant()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("taking a new etcd lease failed: %r", exc)

    async def fresh_lease(self) -> None:
        """A fenced leader steps down (``chronoq.server.failover.PrimaryDuty``): its old lease is
        revoked (its leader key, if etcd still holds it, goes at once: another node may campaign
        without waiting for the TTL; failing that it expires on its own), this node stops being the
        leader, and a new lease with a new ``deadline`` object is granted and kept alive. The old
        ``LeaseDeadline`` stays lost: the fenced broker's ``Leadership`` holds it, not this
        attribute. Raises when etcd grants no lease (the caller retries); a retry revokes again."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        old = self.lease_id
        if old:
            try:
                kv = await asyncio.wait_for(self._kv(), CONNECT_TIMEOUT_S)
                await asyncio.wait_for(kv.revoke_lease(old), CONNECT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - expired already (not found), or etcd away: the grant says
                log.info("revoking the fenced lease %x failed (%s: %s)", old, type(exc).__name__, exc)
        self.leader = None
        self.member = None
        self.deadline = co.LeaseDeadline(self.clock, self.ttl_s * 1000)
        try:
            await asyncio.wait_for(self._kv(), CONNECT_TIMEOUT_S)
            await asyncio.wait_for(self._grant(), CONNECT_TIMEOUT_S)
        except BaseException:
            self.lease_id = old  # (revoked again by the retry)
            await self._drop()
            self._index = (self._index + 1) % len(self.endpoints)
            raise
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive(), name="chronoq-etcd-keepalive")

    async def _close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        try:
            if self._client is not None and self.lease_id:
                await asyncio.wait_for(self._client.revoke_lease(self.lease_id), CONNECT_TIMEOUT_S)
        finally:
            await self._drop()

    # ------------------------------------------------------------------ operations (via ``call``)
    async def view(self) -> co.View:
        kv = await self._kv()
        leader_key, epoch_key, insync_key, _member, members = self.keys
        ok, answers = await kv.transaction(compare=[], success=[
            kv.transactions.get(leader_key), kv.transactions.get(epoch_key), kv.transactions.get(insync_key),
            kv.transactions.get(members, range_end=_prefix_end(members))], failure=[])
        leader, epoch, insync, nodes = answers
        epoch_value, epoch_revision = (int(epoch[0][0]), epoch[0][1].mod_revision) if epoch else (0, 0)
        return co.View(co.Leader.decode(leader[0][0] if leader else None), epoch_value, epoch_revision,
                       co.InSync.decode(insync[0][0] if insync else None),
                       {meta.key.decode()[len(members):]: json.loads(value) for value, meta in nodes})

    async def group_names(self) -> list[str]:
        """The names of the groups etcd holds keys of in this node's cluster (``chronoq cluster
        status --etcd`` naming a group that has none)."""
        kv = await self._kv()
        root = co.cluster_prefix(self.cluster).encode()
        ok, answers = await kv.transaction(compare=[], success=[
            kv.transactions.get(root, range_end=_prefix_end(root))], failure=[])
        names = {meta.key[len(root):].split(b"/", 1)[0].decode(errors="replace") for _value, meta in answers[0]}
        return sorted(name for name in names if name and not name.startswith("@"))

    async def campaign(self, view: co.View, epoch: int, endpoint: str, position: int) -> bool:
        """One compare-and-swap: the leader key is absent and the epoch key unchanged since
        ``view``; then the leader key (on this node's lease), the epoch and an in-sync set of this
        node alone are written together. True: this node leads ``epoch``."""
        kv = await self._kv()
        leader_key, epoch_key, insync_key, _m, _p = self.keys
        leader = co.Leader(self.node, self.node_id, endpoint, epoch)
        won, _ = await kv.transaction(
            compare=[kv.transactions.create(leader_key) == 0, kv.transactions.mod(epoch_key) == view.epoch_revision],
            success=[kv.transactions.put(leader_key, leader.encode(), lease=self.lease_id),
                     kv.transactions.put(epoch_key, str(epoch).encode()),
                     kv.transactions.put(insync_key, co.InSync(epoch, self.node, {self.node: position}).encode())],
            failure=[])
        if won:
            self.leader = leader
            if not self.deadline.holds():  # the lease aged past our deadline while we asked: fenced at once
                self.deadline.lose("its lease deadline passed while it campaigned")
        return won

    async def publish_insync(self, insync: co.InSync) -> bool:
        """Write the in-sync set if this node still leads (the leader key is still its own)."""
        assert self.leader is not None
        kv = await self._kv()
        ok, _ = await kv.transaction(compare=[kv.transactions.value(self.keys[0]) == self.leader.encode()],
                                     success=[kv.transactions.put(self.keys[2], insync.encode())], failure=[])
        if not ok:
            self.deadline.lose("the leader key no longer names it")
        return ok

    async def register(self, role: str, endpoint: str, position: int, epoch: int) -> None:
        """This node's member key (on its lease): issue 23's membership."""
        self.member = co.member_value(self.node, self.node_id, role, endpoint, position, epoch)
        kv = await self._kv()
        await kv.put(self.keys[3], self.member, lease=self.lease_id)

    async def wait_leader_change(self, seen: co.Leader | None, timeout_s: float) -> co.Leader | None:
        """Return the leader once it differs from ``seen`` (a deletion: None), or after
        ``timeout_s`` whatever it is. The watch is created (etcd confirmed it) before the key is
        read, so a change between the two is not missed."""
        kv = await self._kv()
        watch = await kv.watch(self.keys[0])
        try:
            current = await self._leader(kv)
            if current != seen:
                return current

            async def first():
                async for _event in watch:
                    return
            try:
                await asyncio.wait_for(first(), timeout_s)
            except asyncio.TimeoutError:
                pass
        finally:
            await watch.cancel()
        return await self._leader(kv)

    async def _leader(self, kv) -> co.Leader | None:
        value = await kv.get(self.keys[0])
        return co.Leader.decode(value.value if value is not None else None)

    async def _kv(self):
        if self._client is None:
            await self._connect()
        return self._client


def _why(exc: BaseException) -> str:
    """What a failed connect says: the exception's name, and etcd's words when it gave any (a
    refused password, a missing token)."""
    words = str(exc).strip()
    return f"{type(exc).__name__}: {words[:200]}" if words else type(exc).__name__


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def read_view(access, cluster: str, group: str, timeout_s: float = CONNECT_TIMEOUT_S,
              reading=None) -> co.View:
    """What etcd says of a group, read once without a lease (``chronoq cluster status --etcd``,
    tests). Runs its own event loop: call it from a thread that has none running. ``reading``: a
    coroutine function of the connected reader to run instead of ``view`` (chronoq.replication.cluster).
    ``access``: an ``EtcdAccess``, or plain endpoints."""
    from chronoq.core.clock import SYSTEM_CLOCK

    access = EtcdAccess.coerce(access)

    async def read() -> co.View:
        failures = []
        for endpoint in access.endpoints:
            one = EtcdAccess((endpoint,), access.ca, access.cert, access.key, access.user, access.password)
            reader = EtcdCoordinator(one, cluster, group, 2000, "reader", "", SYSTEM_CLOCK)
            try:
                await asyncio.wait_for(reader._connect(), timeout_s)
                return await asyncio.wait_for(reader.view() if reading is None else reading(reader), timeout_s)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - the next endpoint
                failures.append(f"{endpoint}: {_why(exc)}")
            finally:
                await reader._drop()
        raise errors.ClientError(f"etcd cannot be reached ({'; '.join(failures)})")

    return asyncio.run(read())
