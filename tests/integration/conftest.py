"""Integration fixtures: a real ``chronoq serve`` process on loopback.

``chronoq_process(config=...)`` starts ``python -m chronoq serve`` as a subprocess on a free
port, waits for the "chronoq is ready" line, and stops it with SIGTERM at the end (SIGKILL if it
hangs), checking that it stopped cleanly. ``chronoq_endpoint`` is one shared server for the whole
session ("127.0.0.1:port"); tests isolate themselves with their own topic and group names.

Consumer groups are configured through the config file's ``[groups.<name>]`` tables (see
``chronoq.server.consumers.apply_group_config``). ``SHARED_GROUPS`` lists those of the shared
server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_LINE = "chronoq is ready"
HTTP_ANNOUNCED = re.compile(r"HTTP on (http://\S+:(\d+)/)")  # in the ready line (chronoq.server.http)
READY_TIMEOUT_S = 30.0
PORT_PICKS = 3  # starts tried when the gRPC port picked for a child was taken before it bound it
STOP_TIMEOUT_S = 20.0

# Consumer groups of the shared server: name -> settings.
SHARED_GROUPS = {
    "fifo-order": {"fifo": True},
    "fifo-dlq": {"fifo": True, "max_attempts": 2},
    "dlq-concurrent": {"max_attempts": 2},
}


# The official Python client creates some grpc.aio calls from the calling thread, and grpc asks
# asyncio for that thread's current loop. After any ``asyncio.run`` in this process (chronoq.client.client
# tests) the main thread has none, and a client's Telemetry stream then failed to start now and
# then ("There is no current event loop in thread 'MainThread'", then no settings within 10 s).
# A fresh process has one: so does every test here.
_MAIN_THREAD_LOOP = asyncio.new_event_loop()


@pytest.fixture(autouse=True)
def _main_thread_has_an_event_loop():
    if threading.current_thread() is threading.main_thread():
        asyncio.set_event_loop(_MAIN_THREAD_LOOP)
    yield


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



async def start_front_end(data_dir: str, **settings):
    """The gRPC front end in this process and event loop, on a broker of its own (with a group
    committer, as ``chronoq serve`` runs it): for tests that need its objects, not just a port."""
    import types

    from chronoq.broker.broker import Broker
    from chronoq.broker.committer import GroupCommitter
    from chronoq.core.config import BrokerConfig
    from chronoq.server.consumers import ConsumerLoops, open_consumers
    from chronoq.server.grpc_server import GrpcFrontEnd

    config = BrokerConfig(data_dir=data_dir, port=free_port(), **settings).validate()
    broker = Broker(config)
    committer = GroupCommitter(broker)
    committer.start()
    pop, txns = open_consumers(broker, config)
    loops = ConsumerLoops(pop, txns, committer, broker.clock)  # the runtime's POP ticker and checks
    loops.start()
    front = GrpcFrontEnd(types.SimpleNamespace(config=config, broker=broker, committer=committer, pop=pop,
                                               txns=txns, loops=loops))
    await front.start()
    return front


async def stop_front_end(front) -> None:
    from chronoq.server.consumers import close_consumers

    await front.stop()
    front.runtime.loops.close()
    close_consumers(front.runtime.pop, front.runtime.txns)
    await front.runtime.committer.close()
    front.runtime.broker.close()


def groups_toml(groups: dict) -> str:
    lines = []
    for name, values in groups.items():
        lines.append(f'[groups."{name}"]')
        for key, value in values.items():
            lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else value}")
    return "\n".join(lines) + "\n"


class ChronoqProcess:
    """One ``chronoq serve`` subprocess."""

    def __init__(self, data_dir: str, config_text: str = "", extra_args: tuple = (), module: str = "chronoq"):
        self.data_dir = data_dir
        # The HTTP listener (/metrics, console) takes any free port unless the test chose one;
        # the broker announces it, and ``http_port``/``http_url`` are read from that line.
        self.http_port: int | None = None
        self.http_url: str | None = None
        http_args = () if "--http-port" in extra_args else ("--http-port", "0")
        config_args: tuple = ()
        if config_text:
            path = os.path.join(os.path.dirname(data_dir), os.path.basename(data_dir) + ".toml")
            with open(path, "w") as fh:
                fh.write(config_text)
            config_args = ("--config", path)
        self.stderr_path = data_dir + ".stderr.log"
        # A port picked here is free when picked, not when the child binds it: another process
        # (a client's outgoing connection, another test's broker) may take it in between. Such a
        # start is tried again on a fresh port; a port the test chose is its own business.
        chosen = "--port" in extra_args
        for attempt in range(1 if chosen else PORT_PICKS):
            self.port = int(extra_args[extra_args.index("--port") + 1]) if chosen else free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
            port_args = () if chosen else ("--port", str(self.port))
            args = [sys.executable, "-m", module, "serve", "--data-dir", data_dir, *port_args,
                    "--host", "127.0.0.1", *http_args, *extra_args, *config_args]
            if self._spawn(args):
                break
            self.stop(check=False)
            if chosen or f"cannot listen on {self.endpoint}:" not in self.output() or attempt == PORT_PICKS - 1:
                raise RuntimeError(f"chronoq did not become ready in {READY_TIMEOUT_S} s:\n{self.output()}")
        ready = next(line for line in self.lines if READY_LINE in line)
        announced = HTTP_ANNOUNCED.search(ready)
        if announced:  # "http://127.0.0.1:PORT/" (no match: the listener is off)
            self.http_url, self.http_port = announced.group(1), int(announced.group(2))

    def _spawn(self, args: list) -> bool:
        """Start the child; True once it said it is ready."""
        self.lines: list[str] = []
        self._stderr = open(self.stderr_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True, env=env)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self._ready.wait(READY_TIMEOUT_S)
        return any(READY_LINE in line for line in self.lines)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:  # drain until EOF so the pipe never fills
            self.lines.append(line.rstrip("\n"))
            if READY_LINE in line:
                self._ready.set()
        self._ready.set()  # EOF: let the waiter see the failure at once

    def output(self) -> str:
        try:
            with open(self.stderr_path, "r", errors="replace") as fh:
                err = fh.read()[-8000:]
        except OSError:
            err = ""
        return "stdout:\n" + "\n".join(self.lines) + "\nstderr (tail):\n" + err

    def stop(self, check: bool = True) -> int:
        """SIGTERM, wait, SIGKILL if it hangs. With ``check``, insist on a clean stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                if check:
                    raise AssertionError(f"chronoq ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{self.output()}")
        self._reader.join(5)
        self._stderr.close()
        if check:
            assert self.proc.returncode == 0, f"chronoq exited with {self.proc.returncode}:\n{self.output()}"
            assert any("chronoq stopped cleanly" in line for line in self.lines), self.output()
        return self.proc.returncode


@pytest.fixture
def chronoq_process(tmp_path):
    """Factory: ``chronoq_process(config_text="...")`` -> a started ``ChronoqProcess``."""
    started: list[ChronoqProcess] = []

    def start(config_text: str = "", name: str = "data", extra_args: tuple = ()) -> ChronoqProcess:
        proc = ChronoqProcess(str(tmp_path / name), config_text, extra_args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.returncode is None:  # failed starts were stopped already
            proc.stop()


@pytest.fixture(scope="session")
def chronoq_server(tmp_path_factory):
    proc = ChronoqProcess(str(tmp_path_factory.mktemp("chronoq") / "data"), groups_toml(SHARED_GROUPS))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def chronoq_endpoint(chronoq_server) -> str:
    return chronoq_server.endpoint


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
