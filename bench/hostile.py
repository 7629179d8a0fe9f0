"""Hostile HTTP/2 clients against a live broker, one attack at a time (issue 20's "must show").

For each attack: a fresh ``chronoq serve`` (default configuration, loopback, a temporary data
directory), a normal client that keeps calling QueryRoute (grpcio, in a process of its own, one
call every ``--interval-ms``), a second of quiet for reference, then the attack through raw frames
(``bench/hostile_attacks.py``, built with ``bench/h2raw.py``), bounded in count and in time. One JSON
line per attack, and a last line counting the attacks that met the targets:

  rss_growth_mib      the broker's peak VmRSS (sampled every 50 ms) minus its VmRSS before the attack
                      (``value``); beside it VmHWM growth, anonymous memory (RssAnon: the commit log is
                      mapped, so VmRSS also counts log pages read), VmRSS while the attacker's connections
                      are still open (``rss_left_mib``) and once they are closed (``rss_after_close_mib``)
  broker_cpu_s        the broker's CPU (user + system) from the attack's first byte to the call after it
  attacker_closed     the broker closed every attacking connection or sent GOAWAY (``goaway_code``)
  normal_p50/p99/max_ms  the normal client's calls that overlapped the attack, or the first second
                      from its first byte when it ended sooner (failed calls count
                      with the time they took: their timeout, ``normal_failed`` says how many)
  after_ok, after_ms  a QueryRoute on a new channel once the attacker has closed its connections
  alive               the broker process is still running at the end
  meets_targets       rss growth <= 64 MiB, normal p99 <= 50 ms, answered after, alive (``misses``)

Attacks (HTTP2-HARDENING.md): zero_window, zero_window_2000, half_preface, stream_exhaustion,
rapid_reset, made_you_reset, continuation_flood, hpack_bomb, ping_flood, settings_flood,
empty_frames, grpc_4gib. A broker whose RSS grows past ``--rss-cap-mib`` has the attack stopped
(``stopped_at_rss_cap``) and past 1.5 times the cap is killed (``killed_at_rss_cap``, then ``alive`` is
false by our hand): this machine is shared.

    .venv/bin/python bench/hostile.py                       # every attack, ~4-5 minutes
    .venv/bin/python bench/hostile.py --only rapid_reset --only ping_flood
    .venv/bin/python bench/hostile.py --quick               # a fifth of the counts, shorter holds
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import h2raw  # noqa: E402
from bench.grpc_shell import send_request, server_cpu_s, start_server  # noqa: E402
from bench.hostile_attacks import ATTACKS, BIG_BODY, BIG_TOPIC, SECTION, Ctx, route_request  # noqa: E402
from bench.machine import MachineLoad  # noqa: E402

META = (("x-mq-client-id", "hostile-normal@1@1@x"),)
TARGET_RSS_MIB, TARGET_P99_MS = 64, 50
MIN_WINDOW_S = 1.0  # the normal client's calls are measured over at least this long
_MP = mp.get_context("spawn")  # a fresh interpreter for the normal client (no forked gRPC threads)


def emit(metric: str, value, unit: str, **ctx) -> None:
    ctx.setdefault("load1", round(os.getloadavg()[0], 2))
    ctx.setdefault("cpus", os.cpu_count())
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


# ----------------------------------------------------------------------------- the broker
class Broker:
    """``chronoq serve`` on loopback with a fresh data directory; killed on every exit path."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-hostile-")
        self.proc: subprocess.Popen | None = None
        self.proc, self.endpoint = start_server(os.path.join(self.dir, "data"), "sync")  # sync: the default
        self.pid = self.proc.pid
        host, port = self.endpoint.rsplit(":", 1)
        self.host, self.port = host, int(port)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def memory_kib(self) -> dict[str, int]:
        """VmRSS, VmHWM, RssAnon (kB) from /proc/PID/status; empty once the process is gone."""
        out = {}
        try:
            with open(f"/proc/{self.pid}/status") as fh:
                for line in fh:
                    key = line.split(":", 1)[0]
                    if key in ("VmRSS", "VmHWM", "RssAnon"):
                        out[key] = int(line.split()[1])
        except (OSError, ValueError):
            pass
        return out

    def cpu_s(self) -> float | None:
        try:
            return server_cpu_s(self.pid)
        except (OSError, IndexError, ValueError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _stub(endpoint: str):
    import grpc
    from rocketmq.grpc_protocol import service_pb2_grpc
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", -1)])
    return channel, service_pb2_grpc.MessagingServiceStub(channel)


def call_once(endpoint: str, timeout: float = 5.0) -> tuple[bool, float]:
    """One QueryRoute on a new channel (waiting for the connection within ``timeout``)."""
    import grpc
    channel, stub = _stub(endpoint)
    t0 = time.monotonic()
    try:
        stub.QueryRoute(route_request(), metadata=META, timeout=timeout, wait_for_ready=True)
        return True, (time.monotonic() - t0) * 1e3
    except grpc.RpcError:
        return False, (time.monotonic() - t0) * 1e3
    finally:
        channel.close()


def prefill(endpoint: str, messages: int) -> float:
    """``messages`` 64 KiB messages into BIG_TOPIC through grpcio, 16 per SendMessage; seconds taken."""
    channel, stub = _stub(endpoint)
    body, t0 = os.urandom(BIG_BODY), time.monotonic()
    try:
        for _ in range(math.ceil(messages / 16)):
            stub.SendMessage(send_request(BIG_TOPIC, body, 16), metadata=META, timeout=30)
    finally:
        channel.close()
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- the normal client
def _normal_proc(endpoint: str, out, stop, interval_s: float, timeout_s: float, max_s: float) -> None:
    import grpc
    channel, stub = _stub(endpoint)
    request = route_request()
    end = time.monotonic() + max_s
    while not stop.is_set() and time.monotonic() < end:
        t0 = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
        try:
            stub.QueryRoute(request, metadata=META, timeout=timeout_s)
            ok = True
        except grpc.RpcError:
            ok = False
        dt = time.monotonic() - t0
        out.send((t0, dt, ok))
        if dt < interval_s:
            time.sleep(interval_s - dt)
    channel.close()
    out.send(None)


class Normal:
    """The normal client's process and its samples (t0, seconds, ok), drained by a thread."""

    def __init__(self, endpoint: str, interval_s: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._recv, send = _MP.Pipe(duplex=False)
        self._stop = _MP.Event()
        self.samples: list[tuple[float, float, bool]] = []
        self.proc = _MP.Process(target=_normal_proc, args=(endpoint, send, self._stop, interval_s, timeout_s, 900),
                                daemon=True)
        self.proc.start()
        send.close()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            while True:
                item = self._recv.recv()
                if item is None:
                    return
                self.samples.append(item)
        except (EOFError, OSError):
            return

    def wait_ok(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if any(ok for _, _, ok in self.samples[-3:]):
                return True
            time.sleep(0.05)
        return False

    def wait_past(self, t: float, seconds: float) -> None:
        """Until a call that began after ``t`` is in (so every call overlapping before it is)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (self.samples and self.samples[-1][0] > t):
            time.sleep(0.05)

    def stats(self, t0: float, t1: float) -> dict:
        during = [(dt, ok) for s, dt, ok in list(self.samples) if s < t1 and s + dt > t0]
        lat = sorted(dt * 1e3 for dt, _ in during)
        if not lat:
            return {"calls": 0, "failed": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, max(0, math.ceil(q * len(lat)) - 1))], 2)

        return {"calls": len(lat), "failed": sum(1 for _, ok in during if not ok), "p50_ms": pct(0.5),
                "p99_ms": pct(0.99), "max_ms": round(lat[-1], 2)}

    def stop(self) -> None:
        self._stop.set()
        self.proc.join(self.timeout_s + 5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ----------------------------------------------------------------------------- memory watch
class Sampler(threading.Thread):
    """The broker's VmRSS every 50 ms: the peak, and the watchdog (stop the attack past the cap,
    kill the broker past 1.5 times the cap)."""

    def __init__(self, broker: Broker, base_kib: int, cap_mib: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.broker, self.base, self.cap_kib, self.stop = broker, base_kib, cap_mib * 1024, stop
        self.peak_rss = self.peak_anon = 0
        self.capped = self.killed = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            mem = self.broker.memory_kib()
            if not mem:
                return
            self.peak_rss = max(self.peak_rss, mem.get("VmRSS", 0))
            self.peak_anon = max(self.peak_anon, mem.get("RssAnon", 0))
            grown = mem.get("VmRSS", 0) - self.base
            if grown > self.cap_kib and not self.capped:
                self.capped = True
                self.stop.set()
            if grown > self.cap_kib * 3 // 2 and not self.killed:
                self.killed = True
                self.broker.proc.kill()


# ----------------------------------------------------------------------------- one attack
def attacker_outcome(conns: list[h2raw.Conn], seconds: float) -> dict:
    """Did the broker close each attacking connection (EOF, reset, FIN seen by TCP) or send GOAWAY?
    Reads what is there (scanning for GOAWAY) within ``seconds`` overall, at most 32 MiB each."""
    end = time.monotonic() + seconds
    codes = {}
    closed = 0
    for conn in conns:
        left = end - time.monotonic()
        if len(conns) == 1 and left > 0:
            conn.read_until_closed(left, max_bytes=32 << 20)
        else:
            conn.poll(0, max_bytes=1 << 16)
        if conn.closed or conn.goaway_code is not None or conn.peer_closed():
            closed += 1
        if conn.goaway_code is not None:
            name = h2raw.error_name(conn.goaway_code)
            codes[name] = codes.get(name, 0) + 1
    first = next((c for c in conns if c.goaway_code is not None), None)
    resets, statuses = collections.Counter(), collections.Counter()
    for conn in conns:
        resets.update(conn.rst_codes)
        statuses.update(conn.grpc_statuses)
    return {"attacker_closed": bool(conns) and closed == len(conns), "attacker_conns_closed": closed,
            "attacker_conns": len(conns), "goaway_code": h2raw.error_name(first.goaway_code) if first else None,
            "goaway_codes": codes or None,
            "goaway_debug": first.goaway_debug.decode("utf-8", "replace")[:120] if first else None,
            "server_resets": dict(resets), "grpc_statuses": dict(statuses)}


def run_attack(name: str, args) -> dict:
    broker = Broker()
    normal = None
    conns: list[h2raw.Conn] = []
    try:
        context = {"attack": name, "section": SECTION.get(name, "3"), "config": "default (chronoq serve, sync flush)"}
        if name.startswith("zero_window"):
            context["prefill_s"] = round(prefill(broker.endpoint, args.prefill), 2)
        normal = Normal(broker.endpoint, args.interval_ms / 1e3, args.call_timeout)
        if not normal.wait_ok(30):
            raise RuntimeError("the normal client got no answer before the attack")
        time.sleep(args.quiet)  # the quiet second: the normal client's latency without an attack
        now = time.monotonic()
        idle = normal.stats(now - args.quiet, now)

        base = broker.memory_kib()
        stop = threading.Event()
        sampler = Sampler(broker, base.get("VmRSS", 0), args.rss_cap_mib, stop)
        sampler.start()
        machine, cpu0 = MachineLoad(), broker.cpu_s()
        t_start = time.monotonic()
        ctx = Ctx(broker.host, broker.port, args.seconds, args.hold, args.scale, stop, args)
        try:
            info = ATTACKS[name](ctx)
        finally:
            conns = ctx.conns
        t_attack = time.monotonic() - t_start
        outcome = attacker_outcome(conns, 2.0)
        end_mem = broker.memory_kib()
        for conn in conns:
            conn.close()
        # A defended attack can end within one of the normal client's calls: the window spans at
        # least MIN_WINDOW_S from the first byte, so it always holds calls to measure.
        t_end = max(time.monotonic(), t_start + MIN_WINDOW_S)
        time.sleep(max(0.0, t_end - time.monotonic()))
        after_ok, after_ms = call_once(broker.endpoint, args.call_timeout) if broker.alive() else (False, None)
        cpu1 = broker.cpu_s()
        alive = broker.alive()
        closed_mem = broker.memory_kib()  # the attacker gone and one call answered (or not)
        sampler.done.set()  # the peak covers what the broker did after the attacker left, too
        sampler.join()
        normal.wait_past(t_end, args.call_timeout + 2)
        during = normal.stats(t_start, t_end)

        def grown(key: str, mem: dict, peak: int | None = None) -> float | None:
            if key not in base or (peak is None and key not in mem):
                return None
            return round(((peak if peak is not None else mem[key]) - base[key]) / 1024, 1)

        rss = grown("VmRSS", end_mem, max(sampler.peak_rss, end_mem.get("VmRSS", 0), closed_mem.get("VmRSS", 0)))
        result = {
            **context,
            "rss_growth_mib": rss,
            "hwm_growth_mib": grown("VmHWM", closed_mem),
            "rss_anon_growth_mib": grown("RssAnon", end_mem, max(sampler.peak_anon, end_mem.get("RssAnon", 0),
                                                                 closed_mem.get("RssAnon", 0))),
            "rss_left_mib": grown("VmRSS", end_mem),
            "rss_after_close_mib": grown("VmRSS", closed_mem),
            "rss_base_mib": round(base.get("VmRSS", 0) / 1024, 1),
            "broker_cpu_s": round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None,
            **outcome,
            "normal_p50_ms": during["p50_ms"], "normal_p99_ms": during["p99_ms"], "normal_max_ms": during["max_ms"],
            "normal_calls": during["calls"], "normal_failed": during["failed"],
            "normal_idle_p50_ms": idle["p50_ms"], "normal_idle_p99_ms": idle["p99_ms"],
            "after_ok": after_ok, "after_ms": round(after_ms, 2) if after_ms is not None else None,
            "alive": alive,
            "attack_s": round(t_attack, 2), "during_s": round(t_end - t_start, 2),
            "stopped_at_rss_cap": sampler.capped, "killed_at_rss_cap": sampler.killed,
            **info,
            "machine_busy_pct": machine.busy_pct(), "steal_pct": machine.steal_pct(),
        }
        misses = [what for what, bad in (
            ("rss", rss is None or rss > TARGET_RSS_MIB),
            ("p99", during["p99_ms"] is None or during["p99_ms"] > TARGET_P99_MS),
            ("after", not after_ok), ("alive", not alive)) if bad]
        result["meets_targets"], result["misses"] = not misses, misses
        emit(f"hostile_{name}", rss, "MiB", **result)
        return result
    except Exception as exc:  # noqa: BLE001 - one attack's failure is recorded; the next runs
        emit(f"hostile_{name}", None, "MiB", attack=name, error=f"{type(exc).__name__}: {exc}",
             alive=broker.alive())
        return {"attack": name, "meets_targets": False, "misses": ["error"]}
    finally:
        for conn in conns:
            conn.close()
        if normal is not None:
            normal.stop()
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(ATTACKS), help="run this attack (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a fifth of the counts, 5 s limits, 2 s holds")
    ap.add_argument("--seconds", type=float, default=None, help="time limit of each attack's sending (10 s)")
    ap.add_argument("--hold", type=float, default=None, help="seconds the holding attacks keep connections (5 s)")
    ap.add_argument("--hold-long", type=float, default=None,
                    help="seconds half_preface keeps its connections (12 s: past a plausible preface deadline)")
    ap.add_argument("--prefill", type=int, default=None, help="64 KiB messages for zero_window (2048)")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="the normal client's pace")
    ap.add_argument("--call-timeout", type=float, default=5.0, help="the normal client's deadline per call")
    ap.add_argument("--quiet", type=float, default=1.0, help="seconds of normal calls before each attack")
    ap.add_argument("--rss-cap-mib", type=int, default=4096,
                    help="stop an attack once the broker grew this much; kill the broker at 1.5 times it")
    args = ap.parse_args()
    args.scale = 0.2 if args.quick else 1.0
    args.seconds = args.seconds or (5.0 if args.quick else 10.0)
    args.hold = args.hold if args.hold is not None else (2.0 if args.quick else 5.0)
    args.hold_long = args.hold_long if args.hold_long is not None else (3.0 if args.quick else 12.0)
    args.prefill = args.prefill or (512 if args.quick else 2048)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or soft < hard < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    results = [run_attack(name, args) for name in args.only or list(ATTACKS)]
    met = [r["attack"] for r in results if r.get("meets_targets")]
    emit("hostile_attacks_meeting_targets", len(met), "attacks", attacks=len(results), met=met,
         missed={r["attack"]: r.get("misses") for r in results if not r.get("meets_targets")},
         targets={"rss_growth_mib": TARGET_RSS_MIB, "normal_p99_ms": TARGET_P99_MS, "after_ok": True, "alive": True},
         quick=args.quick)


if __name__ == "__main__":
    main()
