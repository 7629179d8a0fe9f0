"""The console's cluster page (``/console/cluster``) and the overview's cluster line: what
``chronoq cluster status`` shows of this node (docs/replication.md), read from the primary's own
replication state on the event loop: ``runtime.replication`` (``chronoq.replication.shipper.PrimaryNode``:
each replica's last pull and lag), and, with etcd, ``runtime.duty`` (``chronoq.server.failover.PrimaryDuty``:
the in-sync set, the lease, fencing) and the group's view read from etcd (``runtime.coordinator``).

Read-only on purpose: promotion stays an operator's (``chronoq promote``) or etcd's decision, and
the page says so. A replica serves no HTTP listener (it opens no broker: only the Replication
service), so this page exists on primaries; a replica's state is ``chronoq cluster status
--endpoint REPLICA``.

``replica_rows`` and ``summary`` are pure; ``cluster_page`` and ``etcd_state`` are the shell.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from chronoq.console import charts
from chronoq.console.views import Console, guarded

ETCD_TIMEOUT_S = 2.0  # the page waits this long for etcd's view, then says it could not read it


def replica_rows(replicas: dict, lags: dict, now_ms: int, in_sync) -> list[dict]:
    """One row per replica of ``PrimaryNode.replicas`` (node id -> (endpoint, position, last pull
    wall ms)), with ``lags`` (``PrimaryNode.lag_figures``: endpoint or node id -> (bytes, seconds)).

    ``in_sync(endpoint, position, last pull ms)``: ``PrimaryNode.counts_in_sync`` (with etcd,
    membership of the published set; without, the rule ``replication = "sync"`` waits by)."""
    rows = []
    for node, (endpoint, pos, seen) in sorted(replicas.items()):
        lag_bytes, lag_s = lags.get(endpoint or node, (0, 0.0))
        rows.append({"node_id": node, "endpoint": endpoint or "(not advertised)", "position": pos,
                     "lag_bytes": lag_bytes, "lag_s": lag_s, "last_pull_ms": seen,
                     "age_s": max(0, now_ms - seen) / 1000, "in_sync": bool(in_sync(endpoint, pos, seen))})
    return rows


def summary(rows: list[dict], role: str, epoch: int) -> str:
    """The overview's one line."""
    if not rows:
        return f"{role}, epoch {epoch}: single node (no replicas)"
    synced = sum(1 for r in rows if r["in_sync"])
    return f"{role}, epoch {epoch}: {len(rows)} replica(s), {synced} in sync"


def _node(console: Console):
    node = console.runtime.replication
    if node is None:  # the broker is open but the primary's side is not made yet (start-up)
        raise web.HTTPServiceUnavailable(text="the broker is starting: no replication state yet\n")
    return node


def gather(console: Console) -> dict:
    """This node's figures now (no await: one moment of the event loop)."""
    broker, runtime = console.broker, console.runtime
    node, cfg = _node(console), runtime.config
    now = broker.clock.wall_ms()
    rows = replica_rows(node.replicas, node.lag_figures(), now,
                        lambda endpoint, pos, seen: node.counts_in_sync(endpoint, pos, seen, now))
    journal = node.pop._journal if node.pop is not None else None
    return {"role": node.role, "epoch": node.epoch, "node_id": node.node_id, "endpoint": cfg.endpoint,
            "commit_end": node.store.log.synced,
            "pop_log": (journal.log.generation, journal.log.size) if journal is not None else (0, 0),
            "mode": cfg.replication, "bound_ms": cfg.replication_sync_timeout_ms, "replicas": rows,
            "summary": summary(rows, node.role, node.epoch)}


async def etcd_state(runtime) -> dict | None:
    """With etcd: the group's view (leader, epoch, in-sync set, members), this node's lease and
    whether it is fenced; None without etcd."""
    coord, duty = runtime.coordinator, runtime.duty
    if coord is None:
        return None
    out = {"cluster": coord.cluster, "group": coord.group, "view": None, "error": "",
           "lease_ms": coord.deadline.remaining_ms(), "fenced": duty is not None and not duty.leadership.holds(),
           "lost": coord.deadline.lost or "", "new_leader": duty.leadership.new_leader if duty is not None else None}
    try:
        out["view"] = await asyncio.wait_for(coord.call(coord.view()), ETCD_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - etcd unavailable: the page says so and shows the rest
        out["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return out


def lag_charts(samples: list) -> dict | None:
    """The worst replica's lag over time (``history.Sample.repl_*``), None before any replica."""
    with_lag = [s for s in samples if s.repl_bytes is not None]
    if not with_lag:
        return None
    return {"bytes": charts.time_lines("Replication lag, worst replica", "bytes",
                                       {"bytes behind": [(s.ts_ms, s.repl_bytes) for s in with_lag]}),
            "seconds": charts.time_lines("Replication lag, worst replica", "seconds",
                                         {"seconds behind": [(s.ts_ms, round(s.repl_s, 3)) for s in with_lag]})}


@guarded(write=False)
async def cluster_page(request: web.Request, console: Console) -> web.Response:
    data = gather(console)
    etcd = await etcd_state(console.runtime)
    history = getattr(console.runtime, "history", None)
    figs = await asyncio.to_thread(lag_charts, list(history.samples)) if history is not None else None
    return console.render(request, "cluster.html", c=data, etcd=etcd, figs=figs, history=history)
