"""Access control: users, their permissions, and the ``MQv2-HMAC-SHA1`` signature check.

Pure: no I/O besides reading a secret from the environment at load time, no ``grpc``. The gRPC
gate (``chronoq.server.auth``) asks this module two questions per request: *who is this?*
(``AccessControl.authenticate``, from the ``authorization`` and ``x-mq-date-time`` headers) and
*may they?* (``AccessControl.require``, with the needs the request's fields imply).

Configuration (TOML; documented in ``docs/security.md``)::

    [auth]
    enabled = true

    [[auth.users]]
    access_key = "orders-app"
    secret_key_env = "ORDERS_APP_SECRET"   # or secret_key = "..." (keep the file private)
    publish = ["orders", "orders.*"]       # topic globs (fnmatch: * ? [seq])
    subscribe = ["orders*"]
    groups = ["billing", "billing-*"]      # consumer-group globs
    admin = false                          # true: every permission, and the admin RPCs

Rules:

- Deny by default: a user may do only what a glob grants; no user, no access.
- ``admin = true`` grants everything, including chronoq's own Admin service.
- ``*`` does not match the broker's own topics (``%DLQ%...``, ``%RETRY%...``, ``CHRONOQ_...``):
  a pattern must spell such a prefix out (``%DLQ%billing``) to grant one.
- An empty ``Credential`` (what the official Python client sends without credentials) is
  anonymous, and anonymous requests are refused when access control is on.

The signature (contract §4.2): ``authorization: MQv2-HMAC-SHA1 Credential=<AK>,
SignedHeaders=x-mq-date-time, Signature=<hex>`` where the signature is HMAC-SHA1 keyed by the
secret over the ``x-mq-date-time`` value. The hex is compared as bytes, so Python's lower case
and Node's upper case both verify; the comparison is constant-time. There is deliberately no
freshness check on the date: the Python client stamps local time with a literal ``Z``, so a
clock window would reject correct clients on any host not set to UTC. (The price: a captured
header can be replayed. Use TLS on untrusted networks; see docs/security.md.)

Secrets never appear in a ``repr``, an exception message or a log line.

In core because three rooms read it: ``core.config`` checks the ``[auth]`` table at load, the gRPC
gate (``chronoq.server.auth``) and the web console (``chronoq.console.access``) enforce it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from chronoq.core import errors, model

SCHEME = "MQv2-HMAC-SHA1"
DATE_HEADER = "x-mq-date-time"
AUTH_HEADER = "authorization"
SIGNATURE_BYTES = 20  # SHA-1

# Kinds of need. TOPIC: publish *or* subscribe (route lookups serve both).
PUBLISH = "publish"
SUBSCRIBE = "subscribe"
TOPIC = "topic"
GROUP = "group"
ADMIN = "admin"
PUBLISHER = "publisher"  # may publish to some topic (a staged batch's Publish/Abort: no topic named)

# An access key travels inside a comma-separated header and ends at the first "/": keep it plain.
_ACCESS_KEY = re.compile(r"[A-Za-z0-9._~@:+\-]{1,128}")
_USER_KEYS = {"access_key", "secret_key", "secret_key_env", "admin", "publish", "subscribe", "groups"}
_AUTH_KEYS = {"enabled", "users"}
_GLOBS_MAX = 1000
_DECISIONS_MAX = 10_000  # per-user memo of (kind, name) -> allowed
_SHOWN_CHARS = 64  # at most this much of a client-supplied string is echoed in a message


def _shown(text: str) -> str:
    """A client-supplied string, quoted and cut, for an error message."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


@dataclass(eq=False)
class User:
    access_key: str
    secret: bytes = field(repr=False)
    admin: bool = False
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    _memo: dict = field(default_factory=dict, repr=False)

    def allowed(self, kind: str, name: str) -> bool:
        if self.admin:
            return True
        key = (kind, name)
        hit = self._memo.get(key)
        if hit is None:
            if kind == PUBLISH:
                hit = _matches(name, self.publish)
            elif kind == SUBSCRIBE:
                hit = _matches(name, self.subscribe)
            elif kind == TOPIC:
                hit = _matches(name, self.publish) or _matches(name, self.subscribe)
            elif kind == GROUP:
                hit = _matches(name, self.groups)
            elif kind == PUBLISHER:
                hit = bool(self.publish)
            else:  # ADMIN, or a kind this version does not know: only admins
                hit = False
            if len(self._memo) >= _DECISIONS_MAX:
                self._memo.clear()
            self._memo[key] = hit
        return hit


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    # An empty name never matches: "*" must not authorize a request that names no resource.
    if not name:
        return False
    # The broker's own topics (%DLQ%..., CHRONOQ_TXN_HALF, ...) match only a pattern that spells
    # their prefix out, so "*" does not open uncommitted transactions or the delay queues.
    if model.is_system_topic(name):
        return any(g.startswith(model.SYSTEM_TOPIC_PREFIXES) and fnmatchcase(name, g) for g in globs)
    return any(fnmatchcase(name, g) for g in globs)


_VERBS = {PUBLISH: "publish to topic", SUBSCRIBE: "subscribe to topic", TOPIC: "use topic",
          GROUP: "use consumer group", PUBLISHER: "publish staged batches: it may publish to no topic"}


class AccessControl:
    """The users of one broker; answers ``authenticate`` and ``require``."""

    def __init__(self, users: list[User]):
        self.users = {u.access_key: u for u in users}

    def __repr__(self) -> str:
        return f"AccessControl(users={sorted(self.users)})"

    def authenticate(self, authorization: str | None, date_time: str | None) -> User:
        """The user whose signature this is; ``errors.Unauthorized`` otherwise."""
        if not authorization:
            raise errors.Unauthorized("authentication required: this broker has access control on; configure the "
                                      "client with an access key and a secret key")
        access_key, signature = parse_authorization(authorization)
        if not access_key:
            raise errors.Unauthorized("authentication required: the request carries no access key (anonymous "
                                      "access is not allowed); configure the client with credentials")
        user = self.users.get(access_key)
        if user is None:
            raise errors.Unauthorized(f"unknown access key {_shown(access_key)}")
        if not date_time:
            raise errors.Unauthorized(f"the {DATE_HEADER} header is missing; it is the value the signature signs")
        expected = hmac.digest(user.secret, date_time.encode("utf-8", "surrogatepass"), hashlib.sha1)
        if not hmac.compare_digest(expected, signature):
            raise errors.Unauthorized(f"signature mismatch for access key {_shown(access_key)}: "
                                      "check the client's secret key")
        return user

    @staticmethod
    def require(user: User, needs, what: str) -> None:
        """Raise ``errors.Forbidden`` unless ``user`` has every ``(kind, name)`` in ``needs``."""
        for kind, name in needs:
            if user.allowed(kind, name):
                continue
            if kind in _VERBS:
                raise errors.Forbidden(f"access key {_shown(user.access_key)} may not {_VERBS[kind]}"
                                       + ("" if kind == PUBLISHER else f" {_shown(name)}") + f" ({what})")
            raise errors.Forbidden(f"access key {_shown(user.access_key)} may not call {what}: "
                                   "it needs the admin role")


def parse_authorization(value: str) -> tuple[str, bytes]:
    """(access key, signature bytes) of an ``authorization`` header; ``errors.Unauthorized`` if malformed.

    The rule of the reference proxy: split at the first space, the rest on ``,``, each item at
    the first ``=``; the access key is ``Credential`` up to the first ``/``; the signature is hex.
    """
    scheme, _, rest = value.strip().partition(" ")
    if scheme != SCHEME:
        raise errors.Unauthorized(f"authorization scheme {_shown(scheme)} is not supported; expected {SCHEME}")
    items: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, val = item.strip().partition("=")
        if eq:
            items[key.strip()] = val.strip()
    if "Credential" not in items or "Signature" not in items:
        raise errors.Unauthorized(f"authorization header is malformed: expected '{SCHEME} Credential=<access key>, "
                                  f"SignedHeaders={DATE_HEADER}, Signature=<hex>'")
    access_key = items["Credential"].split("/", 1)[0]
    sig_text = items["Signature"]
    if len(sig_text) != 2 * SIGNATURE_BYTES:
        raise errors.Unauthorized("authorization signature must be 40 hex digits (HMAC-SHA1)")
    try:
        signature = bytes.fromhex(sig_text)
    except ValueError:
        raise errors.Unauthorized("authorization signature is not hex") from None
    return access_key, signature


def sign(secret_key: str, date_time: str) -> str:
    """The signature a client sends (lower-case hex), for tests and chronoq's own client."""
    return hmac.digest(secret_key.encode(), date_time.encode(), hashlib.sha1).hex()


def authorization_header(access_key: str, secret_key: str, date_time: str) -> str:
    return f"{SCHEME} Credential={access_key}, SignedHeaders={DATE_HEADER}, Signature={sign(secret_key, date_time)}"


# ------------------------------------------------------------------------------------- config
def from_config(table: object, env=None) -> AccessControl | None:
    """Parse the ``[auth]`` table; ``None`` when access control is off. ``errors.ClientError`` if wrong."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise errors.ClientError("[auth] in the config file must be a table")
    unknown = set(table) - _AUTH_KEYS
    if unknown:
        raise errors.ClientError(f"unknown setting(s) {', '.join(sorted(unknown))} in [auth]; known: "
                                 + ", ".join(sorted(_AUTH_KEYS)))
    enabled = table.get("enabled", False)
    if type(enabled) is not bool:
        raise errors.ClientError(f"[auth] enabled must be true or false, not {enabled!r}")
    raw_users = table.get("users", [])
    if not isinstance(raw_users, list):
        raise errors.ClientError("[auth] users must be an array of tables ([[auth.users]])")
    users = [_user(i, raw, os.environ if env is None else env) for i, raw in enumerate(raw_users)]
    seen: set[str] = set()
    for user in users:
        if user.access_key in seen:
            raise errors.ClientError(f"[[auth.users]]: access key {user.access_key!r} is listed twice")
        seen.add(user.access_key)
    if "enabled" not in table and users:  # (users written, the switch forgotten: an open broker)
        raise errors.ClientError("[[auth.users]] are listed but [auth] does not say enabled = true: access control "
                                 "would be off, anyone could connect; set enabled = true (or enabled = false to "
                                 "keep them listed with access control off)")
    if not enabled:
        return None
    if not users:
        raise errors.ClientError("[auth] enabled = true but no [[auth.users]] are configured: nobody could connect")
    return AccessControl(users)


def _user(index: int, raw: object, env) -> User:
    where = f"[[auth.users]] #{index + 1}"
    if not isinstance(raw, dict):
        raise errors.ClientError(f"{where} must be a table")
    unknown = set(raw) - _USER_KEYS
    if unknown:
        raise errors.ClientError(f"unknown setting(s) {', '.join(sorted(unknown))} in {where}; known: "
                                 + ", ".join(sorted(_USER_KEYS)))
    access_key = raw.get("access_key")
    if not isinstance(access_key, str) or not _ACCESS_KEY.fullmatch(access_key):
        raise errors.ClientError(f"{where}: access_key must be 1-128 characters of A-Z a-z 0-9 . _ ~ @ : + -")
    where = f"[[auth.users]] {access_key!r}"
    if ("secret_key" in raw) == ("secret_key_env" in raw):
        raise errors.ClientError(f"{where}: give exactly one of secret_key and secret_key_env")
    if "secret_key" in raw:
        secret = raw["secret_key"]
        if not isinstance(secret, str) or not secret:
            raise errors.ClientError(f"{where}: secret_key must be a non-empty string")
    else:
        var = raw["secret_key_env"]
        if not isinstance(var, str) or not var:
            raise errors.ClientError(f"{where}: secret_key_env must name an environment variable")
        secret = env.get(var, "")
        if not secret:
            raise errors.ClientError(f"{where}: environment variable {var} (secret_key_env) is not set or empty")
    admin = raw.get("admin", False)
    if type(admin) is not bool:
        raise errors.ClientError(f"{where}: admin must be true or false")
    return User(access_key, secret.encode(), admin, _globs(raw, "publish", where), _globs(raw, "subscribe", where),
                _globs(raw, "groups", where))


def _globs(raw: dict, key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(g, str) and g for g in value):
        raise errors.ClientError(f"{where}: {key} must be a list of non-empty name patterns")
    if len(value) > _GLOBS_MAX:
        raise errors.ClientError(f"{where}: {key} has more than {_GLOBS_MAX} patterns")
    return tuple(value)
