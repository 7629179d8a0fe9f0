"""A real etcd on loopback for the failover tests (Debian's etcd-server, installed by
scripts/setup when it can be; the tests skip and say why when it cannot be had).

    from tests.integration.etcd_fixture import etcd  # noqa: F401  (the pytest fixture)

    def test_x(etcd):                # an ``Etcd`` started on free ports, data under tmp_path
        etcd.endpoint                # "127.0.0.1:PORT" for etcd_endpoints
        etcd.config(cluster="c")     # TOML lines: etcd_endpoints, cluster_name, lease_ttl_ms
        etcd.view("c")               # chronoq.replication.coordinator.View of group "default"
        etcd.stop()                  # also done at teardown

``start_etcd(directory)`` starts one outside a fixture.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import time

import pytest

from .conftest import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
LEASE_TTL_MS = 2000  # the tests' TTL: etcd's minimum (2 s with its default heartbeat)


def etcd_available() -> bool:
    return os.path.exists(ETCD) and os.access(ETCD, os.X_OK)


class Etcd:
    """``tls``: (CA, server certificate, server key) PEM paths: clients must present a certificate
    the CA signed (``--client-cert-auth``); ``access`` then says how a test reaches it."""

    def __init__(self, directory: str, tls: tuple[str, str, str] | None = None, access=None,
                 port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        from chronoq.replication.etcd import EtcdAccess

        self.port, peer = port or free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.access = EtcdAccess.coerce(access or [self.endpoint])
        self.log_path = os.path.join(directory, "etcd.log")
        os.makedirs(directory, exist_ok=True)
        self._log = open(self.log_path, "wb")
        url, peer_url = f"{'https' if tls else 'http'}://{self.endpoint}", f"http://127.0.0.1:{peer}"
        security = [] if tls is None else ["--trusted-ca-file", tls[0], "--cert-file", tls[1], "--key-file", tls[2],
                                           "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [ETCD, "--name", "test", "--data-dir", os.path.join(directory, "etcd-data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"test={peer_url}", "--listen-metrics-urls", "", *security, *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.view("probe")
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    with open(self.log_path, errors="replace") as fh:
                        raise RuntimeError(f"etcd did not start:\n{fh.read()[-3000:]}") from None
                time.sleep(0.1)

    def config(self, cluster: str, ttl_ms: int = LEASE_TTL_MS) -> str:
        return f'etcd_endpoints = "{self.endpoint}"\ncluster_name = "{cluster}"\nlease_ttl_ms = {ttl_ms}\n'

    def view(self, cluster: str, group: str = "default"):
        """What etcd says of a group (``chronoq.replication.coordinator.View``), read on a thread of
        its own (the official client wants the test thread's event loop left alone)."""
        from chronoq.replication.etcd import read_view

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(read_view, self.access, cluster, group).result(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_etcd(directory: str) -> Etcd:
    if not etcd_available():
        pytest.skip(f"etcd is not installed ({ETCD}): scripts/setup installs Debian's etcd-server when run as root")
    return Etcd(directory)


@pytest.fixture
def etcd(tmp_path):
    server = start_etcd(str(tmp_path / "etcd"))
    try:
        yield server
    finally:
        server.stop()
