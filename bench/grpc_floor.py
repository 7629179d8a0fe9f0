"""gRPC Python's own per-call and per-message floor: a server that does *no* work.

Serves ``apache.rocketmq.v2.MessagingService`` from a subprocess whose handlers return prebuilt
responses: Heartbeat (a trivial unary call), SendMessage (parses the request, answers a prebuilt
response) and ReceiveMessage (streams N prebuilt 1 KiB messages). It measures the server's CPU
time (user + system, /proc) per call and per message, and the client's. Whatever chronoq costs
above these figures is chronoq's; below them nothing can go on this stack and machine.

    .venv/bin/python bench/grpc_floor.py                         # grpc.aio server on uvloop

``receive_unary`` is the same 16 messages as one unary answer (chronoq's ReceiveBatch shape).
    .venv/bin/python bench/grpc_floor.py --server chronoq          # chronoq's own HTTP/2 server
    .venv/bin/python bench/grpc_floor.py --server sync --threads 4
    GRPC_POLL_STRATEGY=poll .venv/bin/python bench/grpc_floor.py  # env reaches the server

Prints one JSON object per line: {"metric", "value", "unit", ...context}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.grpc_shell import server_cpu_s  # noqa: E402

BODY = os.urandom(1024)
OK = pb.Status(code=pb.OK, message="OK")
HEARTBEAT = sv.HeartbeatResponse(status=OK)
MESSAGE = sv.ReceiveMessageResponse(message=pb.Message(
    topic=pb.Resource(name="bench"), body=BODY,
    system_properties=pb.SystemProperties(message_id="01" * 17, receipt_handle="ab" * 24, queue_offset=1,
                                          body_digest=pb.Digest(type=pb.MD5, checksum="0" * 32))))
SEND_ANSWERS: dict[int, sv.SendMessageResponse] = {}
# A ReceiveBatch-shaped answer (chronoq.protocol.rocketmq.receive.receive_batch): the stream's items in one message.
_MESSAGE_BYTES = MESSAGE.SerializeToString()
_STATUS_BYTES = sv.ReceiveMessageResponse(status=OK).SerializeToString()
UNARY_PATH = "/chronoq.v1.Consume/ReceiveBatch"


def _unary_answer(n: int) -> bytes:
    from chronoq.protocol.rocketmq.receive import receive_batch

    return receive_batch([_STATUS_BYTES] + [_MESSAGE_BYTES] * n)


async def _unary_receive(request, context) -> bytes:
    return _unary_answer(request.batch_size)


def _unary_receive_sync(request, context) -> bytes:
    return _unary_answer(request.batch_size)


def _unary_handler(behavior):
    return grpc.method_handlers_generic_handler("chronoq.v1.Consume", {
        "ReceiveBatch": grpc.unary_unary_rpc_method_handler(behavior,
                                                            request_deserializer=sv.ReceiveMessageRequest.FromString)})


def _send_answer(n: int) -> sv.SendMessageResponse:
    answer = SEND_ANSWERS.get(n)
    if answer is None:
        answer = SEND_ANSWERS[n] = sv.SendMessageResponse(status=OK, entries=[
            sv.SendResultEntry(status=OK, message_id="01" * 17, offset=i) for i in range(n)])
    return answer


class AsyncServicer(service_pb2_grpc.MessagingServiceServicer):
    async def Heartbeat(self, request, context):
        return HEARTBEAT

    async def SendMessage(self, request, context):
        return _send_answer(len(request.messages))

    async def ReceiveMessage(self, request, context):
        yield sv.ReceiveMessageResponse(status=OK)
        for _ in range(request.batch_size):
            yield MESSAGE


class SyncServicer(service_pb2_grpc.MessagingServiceServicer):
    def Heartbeat(self, request, context):
        return HEARTBEAT

    def SendMessage(self, request, context):
        return _send_answer(len(request.messages))

    def ReceiveMessage(self, request, context):
        yield sv.ReceiveMessageResponse(status=OK)
        for _ in range(request.batch_size):
            yield MESSAGE


def serve(kind: str, port: int, threads: int) -> None:
    if kind == "sync":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(threads))
        service_pb2_grpc.add_MessagingServiceServicer_to_server(SyncServicer(), server)
        server.add_generic_rpc_handlers((_unary_handler(_unary_receive_sync),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        if kind == "chronoq":
            from chronoq.server import h2grpc

            server = h2grpc.Server()
        else:
            server = grpc.aio.server()
        service_pb2_grpc.add_MessagingServiceServicer_to_server(AsyncServicer(), server)
        server.add_generic_rpc_handlers((_unary_handler(_unary_receive),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    if kind in ("uvloop", "chronoq"):
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


async def drive(endpoint: str, what: str, calls: int, concurrency: int, batch: int) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        heartbeat = sv.HeartbeatRequest(client_type=pb.PRODUCER)
        send = sv.SendMessageRequest(messages=[pb.Message(
            topic=pb.Resource(name="bench"), body=BODY, system_properties=pb.SystemProperties(
                message_id="01" * 17, body_encoding=pb.IDENTITY, message_type=pb.NORMAL)) for _ in range(batch)])
        receive = sv.ReceiveMessageRequest(batch_size=batch)
        unary = channel.unary_unary(UNARY_PATH, request_serializer=sv.ReceiveMessageRequest.SerializeToString)

        async def worker(n: int) -> None:
            for _ in range(n):
                if what == "heartbeat":
                    await stub.Heartbeat(heartbeat, timeout=30)
                elif what == "send":
                    await stub.SendMessage(send, timeout=30)
                elif what == "receive_unary":
                    await unary(receive, timeout=30)
                else:
                    async for _response in stub.ReceiveMessage(receive, timeout=30):
                        pass

        await worker(20)  # warm up
        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


def emit(metric: str, value: float, unit: str, **context) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 1), "unit": unit, **context}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("aio", "uvloop", "sync", "chronoq"), default="uvloop")
    ap.add_argument("--threads", type=int, default=4, help="sync server: worker threads")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # internal: run the server
    args = ap.parse_args()
    if args.serve:
        serve(args.server, args.serve, args.threads)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--server", args.server, "--threads",
                             str(args.threads), "--serve", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        endpoint = f"127.0.0.1:{port}"
        # (what, calls, concurrent callers, messages per call)
        for what, calls, concurrency, batch in (("heartbeat", 6400, 64, 0), ("send", 1600, 4, 100),
                                                ("receive", 1600, 8, 16), ("receive_unary", 1600, 8, 16)):
            cpu0, wall0 = server_cpu_s(proc.pid), time.perf_counter()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            asyncio.run(drive(endpoint, what, calls, concurrency, batch))
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu, wall = server_cpu_s(proc.pid) - cpu0, time.perf_counter() - wall0
            client = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            n = calls + 20
            ctx = dict(server=args.server, calls=n, concurrency=concurrency, calls_per_s=round(n / wall))
            emit(f"floor_{what}_server_cpu_per_call", cpu / n * 1e6, "us", **ctx)
            if batch:
                emit(f"floor_{what}_server_cpu_per_message", cpu / n / batch * 1e6, "us", messages_per_call=batch,
                     **ctx)
                emit(f"floor_{what}_client_cpu_per_message", client / n / batch * 1e6, "us", messages_per_call=batch,
                     **ctx)
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
