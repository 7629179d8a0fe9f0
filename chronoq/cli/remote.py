"""Talking to a broker from the command line: the options every remote command takes (endpoint,
timeout, --json, credentials, TLS), running one call, and turning a failure into one line on stderr
and the documented exit status (see ``chronoq.cli.main``)."""

from __future__ import annotations

import sys

import click

from chronoq.cli.params import Seconds

DEFAULT_ENDPOINT = "127.0.0.1:8081"
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_DONE = 4           # answered definitely, but nothing changed (already delivered, not found)


def _check_endpoint(ctx, param, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not host:port (e.g. {DEFAULT_ENDPOINT}); it comes from --endpoint "
                                 "or CHRONOQ_ENDPOINT")
    return value


def _keep_connection_option(ctx, param, value):
    """Connection settings (credentials, TLS) go to ``ctx.meta``, not to every command's arguments."""
    ctx.meta[f"chronoq.{param.name}"] = value
    return value


def connection() -> dict:
    """Keyword arguments for ``Client``/``AdminClient``: credentials and TLS of this invocation."""
    meta = click.get_current_context().meta
    return {"access_key": meta.get("chronoq.access_key") or "", "secret_key": meta.get("chronoq.secret_key") or "",
            "tls": bool(meta.get("chronoq.tls")), "tls_ca_file": meta.get("chronoq.tls_ca_file") or ""}


def remote_options(fn):
    """The options every command that talks to a broker takes."""
    fn = click.option("--tls-ca-file", envvar="CHRONOQ_TLS_CA_FILE", type=click.Path(dir_okay=False, exists=True),
                      default=None, expose_value=False, callback=_keep_connection_option,
                      help="PEM certificates to trust for TLS (implies --tls; env CHRONOQ_TLS_CA_FILE). "
                           "Default: the system's roots.")(fn)
    fn = click.option("--tls", is_flag=True, envvar="CHRONOQ_TLS", default=False, expose_value=False,
                      callback=_keep_connection_option, help="Connect over TLS (env CHRONOQ_TLS=1).")(fn)
    fn = click.option("--secret-key", envvar="CHRONOQ_SECRET_KEY", default=None, expose_value=False,
                      callback=_keep_connection_option,
                      help="Secret key to sign requests with (prefer the env CHRONOQ_SECRET_KEY: a flag "
                           "shows in the process list).")(fn)
    fn = click.option("--access-key", envvar="CHRONOQ_ACCESS_KEY", default=None, expose_value=False,
                      callback=_keep_connection_option,
                      help="Access key, when the broker has access control on (env CHRONOQ_ACCESS_KEY).")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Print one JSON document (for scripts).")(fn)
    fn = click.option("--timeout", type=Seconds(min=0.1, max=86_400), default=10.0, show_default=True,
                      help="Seconds to wait for each answer.")(fn)
    fn = click.option("--endpoint", envvar="CHRONOQ_ENDPOINT", default=DEFAULT_ENDPOINT, show_default=True,
                      callback=_check_endpoint, help="host:port of the broker (env CHRONOQ_ENDPOINT).")(fn)
    return fn


def etcd_options(fn):
    """``--etcd`` and how to reach it (TLS, a user), for commands that can read etcd itself."""
    fn = click.option("--etcd-user", envvar="CHRONOQ_ETCD_USER", default=None, expose_value=False,
                      callback=_keep_connection_option,
                      help="etcd user, when etcd's authentication is on (env CHRONOQ_ETCD_USER; the password "
                           "comes from the env CHRONOQ_ETCD_PASSWORD only).")(fn)
    for name, what in (("key", "this client's key for --etcd-cert-file"),
                       ("cert", "a client certificate for etcd's --client-cert-auth (implies TLS)"),
                       ("ca", "PEM certificates to trust for etcd's TLS (implies TLS)")):
        fn = click.option(f"--etcd-{name}-file", envvar=f"CHRONOQ_ETCD_{name.upper()}_FILE", default=None,
                          type=click.Path(dir_okay=False, exists=True), expose_value=False,
                          callback=_keep_connection_option,
                          help=f"{what[0].upper()}{what[1:]} (env CHRONOQ_ETCD_{name.upper()}_FILE).")(fn)
    return click.option("--etcd", default=None, metavar="HOST:PORT[,...]",
                        help="Read etcd itself (its endpoints) instead of asking the node at --endpoint.")(fn)


def etcd_access(etcd: str):
    """The ``EtcdAccess`` of this invocation's ``--etcd`` options (exit 2 on a bad combination)."""
    import os

    from chronoq.core import errors
    from chronoq.replication.etcd import EtcdAccess

    meta = click.get_current_context().meta
    try:
        return EtcdAccess.of([e.strip() for e in etcd.split(",") if e.strip()],
                             meta.get("chronoq.etcd_ca_file") or "", meta.get("chronoq.etcd_cert_file") or "",
                             meta.get("chronoq.etcd_key_file") or "", meta.get("chronoq.etcd_user") or "",
                             os.environ.get("CHRONOQ_ETCD_PASSWORD", ""))
    except errors.ChronoqError as exc:
        fail(exc.message, EXIT_USAGE)


def fail(message: str, exit_code: int):
    click.echo(f"chronoq: error: {message}", err=True)
    sys.exit(exit_code)


def _code_name(code: int) -> str:
    from rocketmq.grpc_protocol import definition_pb2

    return definition_pb2.Code.Name(code) if code in definition_pb2.Code.values() else str(code)


# Refusals caused by this invocation's credentials: say which settings give them.
_CREDENTIAL_HINTS = {
    "UNAUTHORIZED": " (credentials come from --access-key/--secret-key or CHRONOQ_ACCESS_KEY/CHRONOQ_SECRET_KEY)",
    "FORBIDDEN": " (the user is the one of --access-key or CHRONOQ_ACCESS_KEY; this needs a permission it lacks)",
}
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "wrong_version", "socket closed")


def _transport_message(endpoint: str, timeout_s: float, exc) -> str:
    import grpc

    code, details = exc.code(), (exc.details() or "").strip()
    if code == grpc.StatusCode.UNAVAILABLE and any(w in details.lower() for w in _TLS_WORDS):
        return (f"cannot reach a broker at {endpoint} ({details}). TLS on one side only? Set --tls or "
                "CHRONOQ_TLS=1 for a broker with TLS (and --tls-ca-file or CHRONOQ_TLS_CA_FILE for its "
                "certificate), leave them unset for one without; the address is --endpoint or CHRONOQ_ENDPOINT.")
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach a broker at {endpoint} ({details}). Is `chronoq serve` running there? "
                "Set --endpoint or CHRONOQ_ENDPOINT.")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {endpoint} within {timeout_s:g} s (raise --timeout if the broker is busy)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"the server at {endpoint} does not offer this call ({details}); is it chronoq? "
                "(a RocketMQ proxy has no chronoq.v1.Admin service)")
    return f"{code.name} from {endpoint}: {details}"


def call(endpoint: str, timeout_s: float, work):
    """Run the coroutine ``work``; a failure becomes one line on stderr and an exit status."""
    import grpc

    from chronoq.client.client import ClientError, run

    try:
        return run(work)
    except ClientError as exc:
        name = _code_name(exc.code)
        fail(f"{name}: {exc.status_message}{_CREDENTIAL_HINTS.get(name, '')}", EXIT_REFUSED)
    except grpc.aio.AioRpcError as exc:
        fail(_transport_message(endpoint, timeout_s, exc), EXIT_UNREACHABLE)
    except KeyboardInterrupt:
        fail("interrupted", 130)



def admin_call(endpoint: str, timeout_s: float, method: str, *args, **kwargs):
    """Call one ``AdminClient`` method against ``endpoint``."""
    from chronoq.client.admin import AdminClient

    async def work():
        async with AdminClient(endpoint, request_timeout_s=timeout_s, **connection()) as admin:
            return await getattr(admin, method)(*args, **kwargs)

    return call(endpoint, timeout_s, work())

