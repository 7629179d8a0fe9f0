"""The error taxonomy.

Every failure chronoq raises on purpose is a ``ChronoqError`` with a stable ``kind``. Core modules
raise these types only; the protocol shell converts them to RocketMQ status codes in exactly one
place (``chronoq.protocol.rocketmq.status``). Anything else escaping the core is a bug.

- ``ClientError``: the request was wrong; retrying it unchanged will fail again.
- ``NotFound``: the thing named does not exist (unknown topic, expired handle).
- ``StorageError``: the disk refused (full, I/O error); the request may succeed later.
  ``DataDirLocked``, one of them, is raised only when opening: another process holds the directory.
- ``CorruptionError``: stored data failed validation; an operator has to look.
"""

from __future__ import annotations

import os


class ChronoqError(Exception):
    kind = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ClientError(ChronoqError):
    kind = "bad_request"


class InvalidTopic(ClientError):
    kind = "illegal_topic"


class InvalidGroup(ClientError):
    kind = "illegal_group"


class ReservedName(ClientError):
    kind = "illegal_topic"


class BodyEmpty(ClientError):
    kind = "body_empty"


class BodyTooLarge(ClientError):
    kind = "body_too_large"


class InvalidMessageId(ClientError):
    kind = "illegal_message_id"


class InvalidTag(ClientError):
    kind = "illegal_tag"


class InvalidKey(ClientError):
    kind = "illegal_key"


class InvalidProperty(ClientError):
    kind = "illegal_property"


class PropertiesTooLarge(ClientError):
    kind = "properties_too_large"


class InvalidQueue(ClientError):
    kind = "bad_request"


class InvalidOffset(ClientError):
    kind = "illegal_offset"


class DuplicateMessageId(ClientError):
    kind = "illegal_message_id"


class MessageTypeMismatch(ClientError):
    kind = "type_conflict"


class InvalidReceiptHandle(ClientError):
    """Unknown, malformed or stale (acked, revived, or replaced by change-invisible-time)."""

    kind = "invalid_receipt_handle"


class InvalidInvisibleTime(ClientError):
    kind = "illegal_invisible_time"


class InvalidFilter(ClientError):
    kind = "illegal_filter"


class InvalidDeliveryTime(ClientError):
    kind = "illegal_delivery_time"


class InvalidTransaction(ClientError):
    kind = "invalid_transaction_id"


class TooManyRequests(ChronoqError):
    kind = "too_many_requests"


class Unauthorized(ChronoqError):
    """No valid credentials: missing, unknown access key, or a signature that does not verify."""

    kind = "unauthorized"


class Forbidden(ChronoqError):
    """Valid credentials, but the user lacks the permission the request needs."""

    kind = "forbidden"


class Unsupported(ChronoqError):
    kind = "unsupported"


class NotFound(ChronoqError):
    kind = "not_found"


class TopicNotFound(NotFound):
    kind = "topic_not_found"


class GroupNotFound(NotFound):
    kind = "group_not_found"


class StorageError(ChronoqError):
    kind = "storage"


class DiskFull(StorageError):
    kind = "disk_full"


class DataDirLocked(StorageError):
    """Another process (or another open ``Broker``/``Store`` in this one) holds the data directory's
    lock (``chronoq.store.dirlock``). Raised at open, before anything in the directory was read."""

    def __init__(self, data_dir: str, lock_path: str, holder_pid: int | None, in_this_process: bool = False):
        if in_this_process:
            who = f"is already open in this process (PID {os.getpid()}): close the other Broker first"
        else:
            pid = f"PID {holder_pid}" if holder_pid is not None else "PID unknown"
            who = (f"is in use by another chronoq process ({pid}): stop it, or use another data directory "
                   f"(one process per directory)")
        super().__init__(f"data directory {data_dir} {who}; lock file {lock_path}")
        self.data_dir = data_dir
        self.lock_path = lock_path
        self.holder_pid = holder_pid
        self.in_this_process = in_this_process


class CorruptionError(ChronoqError):
    """Stored data failed validation where truncation is not allowed.

    Names the file and byte offset so an operator can inspect it, and says what to do next.
    """

    kind = "corruption"

    def __init__(self, path: str, offset: int, reason: str, advice: str | None = None):
        # ``advice``: what to do, for a file that is not a log (a damaged topics.json has no part
        # to quarantine); by default the log's.
        super().__init__(
            f"corrupt data in {path} at byte {offset}: {reason}. " + (advice or (
                "chronoq will not truncate the middle of the log. Inspect or back up the file, then restart "
                "with --quarantine to move the damaged part aside and continue (the lost range is reported)."))
        )
        self.path = path
        self.offset = offset
        self.reason = reason


class ClosedError(ChronoqError):
    kind = "closed"


class InvalidMessageGroup(ClientError):
    kind = "illegal_message_group"


class NotYetImplemented(ChronoqError):
    """A feature chronoq will have but this build does not (delay, transactions, recall, ...)."""

    kind = "not_implemented"


class PreconditionFailed(ChronoqError):
    """The request is well formed but this node's role or state refuses it (a send to a replica,
    a replica pointed at itself, at another replica, or at a primary whose log its own does not
    prefix: ``chronoq.replication``)."""

    kind = "precondition_failed"


class ReplicaTimeout(ChronoqError):
    """``replication = "sync"``: the record is durable here, but no in-sync replica reported it
    durable in time (``chronoq.replication.shipper``). A resend with the same message id is
    answered from the dedupe window, not stored twice."""

    kind = "replica_timeout"
