"""``--http-port 0`` ("any free port") never keeps the gRPC port.

HTTP listens before recovery and gRPC only after it, so the OS could hand HTTP's free-port pick the
very port gRPC then asks for, and the start failed on gRPC's bind (seen once in CI). The test makes
the collision certain: the gRPC port is set to whatever the first real pick was. The listener, its
sockets and aiohttp are real; only the runtime around them is a namespace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import types

from chronoq.core.config import BrokerConfig
from chronoq.server.http import HttpFrontEnd


def _runtime(tmp_path, http_port: int = 0):
    config = BrokerConfig(data_dir=str(tmp_path), host="127.0.0.1", port=1, http_host="127.0.0.1",
                          http_port=http_port).validate()
    return types.SimpleNamespace(config=config)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_free_port_pick_that_is_the_grpc_port_is_dropped_for_another(tmp_path):
    async def run():
        front = HttpFrontEnd(_runtime(tmp_path))
        real_listen, picks = front._listen, []

        async def listen():
            listening = await real_listen()  # (runner, listener)
            picks.append(listening[1].sockets[0].getsockname()[1])
            if len(picks) == 1:
                front.config = dataclasses.replace(front.config, port=picks[0])  # gRPC asked for exactly what the OS picked first
            return listening

        front._listen = listen
        await front.start()
        try:
            assert len(picks) == 2 and picks[1] != picks[0]
            assert front.port == picks[1]
            assert _bindable(picks[0]), "the refused pick is released for gRPC"
            assert not _bindable(front.port)
        finally:
            await front.stop()

    asyncio.run(run())


def test_a_chosen_http_port_is_kept_as_is(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        chosen = s.getsockname()[1]

    async def run():
        front = HttpFrontEnd(_runtime(tmp_path, http_port=chosen))
        await front.start()
        try:
            assert front.port == chosen and not _bindable(chosen)
        finally:
            await front.stop()

    asyncio.run(run())
