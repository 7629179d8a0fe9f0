"""The one place where chronoq errors become ``apache.rocketmq.v2`` status codes.

Every RPC of the gRPC shell (and of the admin service) catches exceptions at a single boundary
and calls ``code_and_message``. A ``ChronoqError`` maps by its ``kind``; anything else is a bug in chronoq:
it is logged with its traceback and answered ``INTERNAL_ERROR`` without leaking details.

Why these codes (see ``shared/protocol/rocketmq-v2-contract.md`` §6.3):

- Client mistakes use the specific 400xx code the official clients map to ``BadRequestException``.
- Storage trouble (disk full, I/O error, a broker that is shutting down) is
  ``INTERNAL_SERVER_ERROR`` (50001): the clients retry it, and it may succeed later.
- Access control (``chronoq.server.auth``): no valid credentials is ``UNAUTHORIZED`` (40100),
  a known user without the permission is ``FORBIDDEN`` (40300).
- ``TOO_MANY_REQUESTS`` is the only code that stops the Python producer's immediate resends.
- Features this build does not have yet answer ``NOT_IMPLEMENTED`` (50100); features chronoq does
  not plan to offer (lite topics, SQL filters, priority) answer ``UNSUPPORTED`` (50500).
"""

from __future__ import annotations

import logging

from rocketmq.grpc_protocol import definition_pb2

from chronoq.core import errors

log = logging.getLogger("chronoq.server")  # (the name operators filter on)

Code = definition_pb2.Code

OK = Code.OK
MESSAGE_NOT_FOUND = Code.MESSAGE_NOT_FOUND

# errors.ChronoqError.kind -> Code. Every kind in chronoq.core.errors is listed (a test checks it).
KIND_TO_CODE: dict[str, int] = {
    "bad_request": Code.BAD_REQUEST,
    "illegal_topic": Code.ILLEGAL_TOPIC,
    "illegal_group": Code.ILLEGAL_CONSUMER_GROUP,
    "illegal_tag": Code.ILLEGAL_MESSAGE_TAG,
    "illegal_key": Code.ILLEGAL_MESSAGE_KEY,
    "illegal_message_group": Code.ILLEGAL_MESSAGE_GROUP,
    "illegal_property": Code.ILLEGAL_MESSAGE_PROPERTY_KEY,
    "invalid_transaction_id": Code.INVALID_TRANSACTION_ID,
    "illegal_message_id": Code.ILLEGAL_MESSAGE_ID,
    "illegal_filter": Code.ILLEGAL_FILTER_EXPRESSION,
    "illegal_invisible_time": Code.ILLEGAL_INVISIBLE_TIME,
    "illegal_delivery_time": Code.ILLEGAL_DELIVERY_TIME,
    "invalid_receipt_handle": Code.INVALID_RECEIPT_HANDLE,
    "type_conflict": Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
    "illegal_offset": Code.ILLEGAL_OFFSET,
    "not_found": Code.NOT_FOUND,
    "topic_not_found": Code.TOPIC_NOT_FOUND,
    "group_not_found": Code.CONSUMER_GROUP_NOT_FOUND,
    "body_too_large": Code.MESSAGE_BODY_TOO_LARGE,
    "body_empty": Code.MESSAGE_BODY_EMPTY,
    "properties_too_large": Code.MESSAGE_PROPERTIES_TOO_LARGE,
    "too_many_requests": Code.TOO_MANY_REQUESTS,
    "unauthorized": Code.UNAUTHORIZED,
    "forbidden": Code.FORBIDDEN,
    "storage": Code.INTERNAL_SERVER_ERROR,
    "disk_full": Code.INTERNAL_SERVER_ERROR,
    "corruption": Code.INTERNAL_SERVER_ERROR,
    "closed": Code.INTERNAL_SERVER_ERROR,
    "internal": Code.INTERNAL_ERROR,
    "not_implemented": Code.NOT_IMPLEMENTED,
    "unsupported": Code.UNSUPPORTED,
    "precondition_failed": Code.PRECONDITION_FAILED,
    "replica_timeout": Code.SLAVE_PERSISTENCE_TIMEOUT,
}

# Kinds whose cause is on the server side: worth a log line (without the traceback).
_SERVER_SIDE = frozenset({"storage", "disk_full", "corruption", "internal"})


def code_and_message(exc: BaseException, what: str = "request") -> tuple[int, str]:
    """(Code, human-readable message) for an exception raised while serving ``what``."""
    if isinstance(exc, errors.ChronoqError):
        code = KIND_TO_CODE.get(exc.kind)
        if code is None:  # a kind added to errors.py but not here: still answer, but say so
            log.error("no status code for error kind %r (%s); answering INTERNAL_ERROR", exc.kind, exc.message)
            return Code.INTERNAL_ERROR, exc.message
        if exc.kind in _SERVER_SIDE:
            log.error("%s failed: %s", what, exc.message)
        return code, exc.message
    log.error("%s failed with an unexpected error (a chronoq bug)", what, exc_info=exc)
    return Code.INTERNAL_ERROR, (f"internal error in chronoq while serving {what}: "
                                 f"{type(exc).__name__}; see the broker log")
