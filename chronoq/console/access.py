"""Who may see the console and who may change things through it. Pure: headers in, a decision out.

The rule (docs/console.md, "Access"):

- ``[auth] enabled = false`` (the default): the pages are open to whoever reaches the port (it
  binds 127.0.0.1 unless configured otherwise) and the console is **read-only**: no admin
  credential exists, so every write action is refused (403).
- ``[auth] enabled = true``: every page needs a valid access key and secret of ``[[auth.users]]``
  given by HTTP basic auth (user name = access key, password = secret key); without them, 401
  with a ``WWW-Authenticate`` challenge so a browser asks. Write actions need a user with
  ``admin = true``; any other valid user gets 403.

Write actions are POSTs. A browser sends basic-auth credentials with any request to the origin,
including one a hostile page makes it send (cross-site request forgery), so a POST whose
``Origin`` (or, without one, ``Referer``) names another origin than the console's own is refused
too.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from chronoq.core import acl

REALM = "chronoq console"


@dataclass(frozen=True, slots=True)
class Decision:
    status: int            # 200 allowed, 401 ask for credentials, 403 refused
    user: str | None       # access key of the authenticated user (None: auth off or unknown)
    reason: str = ""


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """(user, password) of an ``Authorization: Basic`` header, None if absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        text = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    user, sep, password = text.partition(":")
    return (user, password) if sep else None


def _authenticate(access: acl.AccessControl, header: str | None) -> acl.User | None:
    creds = basic_credentials(header)
    if creds is None:
        return None
    user = access.users.get(creds[0])
    # compare_digest on bytes: the time taken does not tell how much of the secret matched.
    if user is None or not hmac.compare_digest(user.secret, creds[1].encode("utf-8", "surrogatepass")):
        return None
    return user


def decide(access: acl.AccessControl | None, authorization: str | None, *, write: bool) -> Decision:
    """May this request go on? ``access`` is ``acl.from_config(config.extra.get("auth"))``."""
    if access is None:
        if write:
            return Decision(403, None, "the console is read-only: access control is off, so no admin "
                                       "credential is configured ([auth] in docs/security.md)")
        return Decision(200, None)
    user = _authenticate(access, authorization)
    if user is None:
        return Decision(401, None, "this broker has access control on: sign in with an access key and "
                                   "its secret key")
    if write and not user.admin:
        return Decision(403, user.access_key, f"access key {user.access_key!r} may not change anything here: "
                                              "that needs a user with admin = true")
    return Decision(200, user.access_key)


def addressed_here(host: str | None, allowed: tuple[str, ...]) -> bool:
    """With access control off, whether a request's ``Host`` names this machine in a way no other
    site can borrow: an IP address, ``localhost``, or a name the operator listed
    (``[console] allowed_hosts``). A page of another site that points its own name at 127.0.0.1
    (DNS rebinding) is same-origin with the console for the browser, and could read every page,
    message bodies included; its requests carry its own name."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == "localhost" or name.endswith(".localhost") or name in allowed


def same_origin(host: str | None, origin: str | None, referer: str | None) -> bool:
    """Whether a write request comes from the console's own pages (see the module docstring).

    A request with neither header (a script, curl) passes: forgery needs a browser, and browsers
    send ``Origin`` with every cross-site POST.
    """
    source = origin if origin and origin != "null" else referer
    if not source:
        return origin != "null"
    return bool(host) and urlsplit(source).netloc.lower() == host.lower()
