"""etcd over TLS with client certificates and authentication on (docs/replication.md, "etcd with
TLS and a user"): a real etcd started with ``--client-cert-auth`` and a CA made here with openssl,
its ``root`` user and authentication enabled; a chronoq node configured with the CA, a client
certificate and the user (the password from the environment) leads its group and serves; the
CLI reads etcd the same way. Refused, with the reason said: plaintext to that etcd, a wrong
password, half a client certificate."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from chronoq.replication.etcd import EtcdAccess

from .conftest import ROOT, ChronoqProcess, free_port, wait_until
from .etcd_fixture import LEASE_TTL_MS, Etcd, etcd_available

PASSWORD = "etcd-root-pw-7f3a"


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(directory: str) -> dict[str, str]:
    """A CA, etcd's certificate (for 127.0.0.1) and a client certificate (CN chronoq-node: no etcd
    user of that name, so the certificate alone grants nothing once authentication is on)."""
    os.makedirs(directory, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=chronoq-test-ca", cwd=directory)
    for name, cn, usage in (("server", "127.0.0.1", "serverAuth,clientAuth"), ("client", "chronoq-node", "clientAuth")):
        with open(os.path.join(directory, f"{name}.ext"), "w") as fh:
            fh.write(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)
    return {n: os.path.join(directory, n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def _enable_auth(access: EtcdAccess) -> None:
    """etcd's ``root`` user and role, then authentication on (as ``etcdctl user add``, ``auth enable``)."""
    from aetcd import rpc

    async def run() -> None:
        client = access.client(access.endpoints[0], 5)
        await client.connect()
        try:
            stub = client.auth_stub
            await stub.UserAdd(rpc.AuthUserAddRequest(name="root", password=PASSWORD), timeout=5)
            await stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
            await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            await stub.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
        finally:
            await client.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result(30)


@contextlib.contextmanager
def _secure_etcd(tmp_path, *extra: str):
    if not etcd_available() or shutil.which("openssl") is None:
        pytest.skip("etcd or openssl is not installed (scripts/setup installs Debian's etcd-server)")
    pem = _certificates(str(tmp_path / "pki"))
    port = free_port()
    # (its start-up probe reads as a client of the CA, before authentication is on)
    tls_only = EtcdAccess.of([f"127.0.0.1:{port}"], pem["ca.pem"], pem["client.pem"], pem["client.key"])
    server = Etcd(str(tmp_path / "etcd"), tls=(pem["ca.pem"], pem["server.pem"], pem["server.key"]),
                  access=tls_only, port=port, extra=extra)
    try:
        _enable_auth(tls_only)
        server.access = EtcdAccess.of([server.endpoint], pem["ca.pem"], pem["client.pem"], pem["client.key"],
                                      "root", PASSWORD)
        yield server, pem
    finally:
        server.stop()


@pytest.fixture
def secure_etcd(tmp_path):
    with _secure_etcd(tmp_path) as made:
        yield made


def _config(server, pem: dict, cluster: str, **override: str) -> str:
    settings = {"etcd_endpoints": server.endpoint, "cluster_name": cluster, "etcd_ca_file": pem["ca.pem"],
                "etcd_cert_file": pem["client.pem"], "etcd_key_file": pem["client.key"], "etcd_user": "root",
                **override}
    lines = [f'{k} = "{v}"' for k, v in settings.items() if v is not None]
    return "\n".join(lines) + f"\nlease_ttl_ms = {LEASE_TTL_MS}\ntrace_enabled = false\n"


def _serve(tmp_path, name: str, config: str, password: str) -> subprocess.CompletedProcess:
    """``chronoq serve`` expected to stop by itself (a refusal at start)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(config)
    return subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / name),
                           "--port", str(free_port()), "--http-port", "off", "--config", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, CHRONOQ_ETCD_PASSWORD=password))


def _cli(*args: str, password: str = PASSWORD) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, CHRONOQ_ETCD_PASSWORD=password))


def test_a_node_leads_through_an_etcd_with_tls_client_certificates_and_a_user(tmp_path, secure_etcd, monkeypatch):
    server, pem = secure_etcd
    monkeypatch.setenv("CHRONOQ_ETCD_PASSWORD", PASSWORD)  # (ChronoqProcess passes the environment on)
    node = ChronoqProcess(str(tmp_path / "a"), _config(server, pem, "sec"))
    try:
        wait_until(lambda: getattr(server.view("sec").leader, "endpoint", None) == node.endpoint, 30,
                   interval_s=0.1, what="the node to lead its group")
        sent = _cli("send", "orders", "over-tls", "--endpoint", node.endpoint, "--json")
        assert sent.returncode == 0, sent.stderr
        etcd_args = ("--etcd", server.endpoint, "--cluster-name", "sec", "--etcd-ca-file", pem["ca.pem"],
                     "--etcd-cert-file", pem["client.pem"], "--etcd-key-file", pem["client.key"], "--etcd-user", "root")
        shown = _cli("cluster", "status", *etcd_args, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["leader"]["endpoint"] == node.endpoint
        refused = _cli("cluster", "status", *etcd_args, "--json", password="not-the-password")
        assert refused.returncode != 0 and "etcd cannot be reached" in refused.stderr, refused.stderr
        assert "authentication failed" in refused.stderr, refused.stderr
    finally:
        node.stop()


def test_plaintext_a_wrong_password_or_half_a_certificate_is_refused_at_start(tmp_path, secure_etcd):
    server, pem = secure_etcd
    plain = _serve(tmp_path, "plain", _config(server, pem, "sec", etcd_ca_file=None, etcd_cert_file=None,
                                              etcd_key_file=None), PASSWORD)
    assert plain.returncode == 1 and f"etcd cannot be reached ({server.endpoint}" in plain.stderr, plain.stderr[-2000:]
    wrong = _serve(tmp_path, "wrong", _config(server, pem, "sec"), "not-the-password")
    assert wrong.returncode == 1 and "authentication failed" in wrong.stderr, wrong.stderr[-2000:]
    half = _serve(tmp_path, "half", _config(server, pem, "sec", etcd_key_file=None), PASSWORD)
    assert half.returncode == 2 and "etcd_cert_file and etcd_key_file go together" in half.stderr, half.stderr[-2000:]
    for name in ("plain", "wrong", "half"):
        assert not (tmp_path / name / "commitlog").exists()  # nothing opened, nothing written
    assert server.view("sec").leader is None


def test_a_token_that_expired_while_the_leader_was_idle_is_asked_for_again(tmp_path, monkeypatch):
    # etcd forgets a token unused for --auth-token-ttl seconds (300 by default; 1 here): the
    # leader, idle longer than that, must still publish the in-sync set when a replica joins.
    with _secure_etcd(tmp_path, "--auth-token-ttl", "1") as (server, pem):
        monkeypatch.setenv("CHRONOQ_ETCD_PASSWORD", PASSWORD)
        config = _config(server, pem, "ttl")
        leader = ChronoqProcess(str(tmp_path / "a"), config)
        replica = None
        try:
            wait_until(lambda: getattr(server.view("ttl").leader, "endpoint", None) == leader.endpoint, 30,
                       interval_s=0.1, what="the node to lead its group")
            time.sleep(4)  # (idle: its token expires in etcd)
            replica = ChronoqProcess(str(tmp_path / "b"), config)
            wait_until(lambda: (server.view("ttl").insync is not None
                                and replica.endpoint in server.view("ttl").insync.members), 30, interval_s=0.2,
                       what="the leader to publish the replica in the in-sync set")
        finally:
            if replica is not None:
                replica.stop()
            leader.stop()
