"""What every RPC of ``MessagingService`` shares: the one exception boundary, request headers, and
the request types that keep their bytes for the hand-written readers of
``chronoq.protocol.rocketmq``."""

from __future__ import annotations

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.core import errors
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.ack import split_ack_and_receive_request

CLIENT_ID_HEADER = "x-mq-client-id"
LANGUAGE_HEADER = "x-mq-language"
# The official clients' ids are ~40-80 characters (host, pid, a counter, a time). The broker keeps
# the ids it sees (auto-renew liveness, Telemetry sessions, transaction checks): a 60 KB id per
# heartbeat grew it by gigabytes.
CLIENT_ID_CHARS_MAX = 256


def client_id(context) -> str:
    """The caller's ``x-mq-client-id`` ("" if none), at most CLIENT_ID_CHARS_MAX printable
    characters; else ClientError (BAD_REQUEST). With access control on, the signed-in user's own:
    ``<access key>/<id>`` (``chronoq.server.auth.CLIENT_SCOPED`` gives the context a
    ``client_scope``), so one user's id names nothing of another's."""
    value = header(context, CLIENT_ID_HEADER)
    if len(value) > CLIENT_ID_CHARS_MAX:
        raise errors.ClientError(f"{CLIENT_ID_HEADER} is {len(value)} characters; at most {CLIENT_ID_CHARS_MAX} allowed")
    if not value.isprintable():
        raise errors.ClientError(f"{CLIENT_ID_HEADER} holds a control character")
    scope = getattr(context, "client_scope", "")
    return f"{scope}/{value}" if scope and value else value


def status_of(exc: BaseException, what: str):
    code, message = status.code_and_message(exc, what)
    return pb.Status(code=code, message=message)


def header(context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""


def status_only(response_type):
    """``boundary``'s answer for an RPC answered by a generated class: the response with the status alone."""
    return lambda code, message: response_type(status=pb.Status(code=code, message=message))


def boundary(refused, what: str):
    """The one exception boundary of a unary RPC: any exception becomes the response's status,
    ``refused(code, message)`` (``status_only(ResponseType)``, or a hand encoder)."""

    def wrap(fn):
        async def handler(self, request, context):
            try:
                return await fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - this is the boundary
                self._count_refusal(exc, context, what)
                return refused(*status.code_and_message(exc, what))

        handler.__name__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler

    return wrap


class AckAndReceiveRequest:
    """A ``chronoq.v1.Consume/AckAndReceive`` request (``chronoq.protocol.rocketmq.ack``): an
    AckMessageRequest and a ReceiveMessageRequest. ``chronoq.server.auth`` reads ``ack`` and
    ``receive`` to check rights."""

    __slots__ = ("ack", "receive")

    def __init__(self, ack, receive) -> None:
        self.ack = ack
        self.receive = receive

    @classmethod
    def parse(cls, blob: bytes) -> "AckAndReceiveRequest":
        """ValueError (or protobuf's DecodeError) when malformed: the gate answers BAD_REQUEST."""
        ack, receive = split_ack_and_receive_request(blob)
        return cls(sv.AckMessageRequest.FromString(ack), sv.ReceiveMessageRequest.FromString(receive))


class SendRequest:
    """A SendMessageRequest and the bytes it was parsed from: ``send.send_columns`` reads its
    columns from the bytes (a third of the cost of reading the parsed messages). Parsed at once,
    so malformed bytes fail where any request's would. ``chronoq.server.auth`` reads ``messages``."""

    __slots__ = ("raw", "messages")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.messages = sv.SendMessageRequest.FromString(raw).messages

    @classmethod
    def parse(cls, raw: bytes) -> "SendRequest":
        return cls(bytes(raw))


def serialize_answer(response) -> bytes:
    """A response serializer that lets a handler answer bytes it encoded itself
    (``chronoq.protocol.rocketmq``)."""
    return response if type(response) is bytes else response.SerializeToString()
