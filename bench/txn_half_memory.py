"""Bytes one pending transactional half costs the broker (what sets max_pending_transactions'
default, docs/security.md): ``--count`` halves are sent through the broker API, then the broker
is reopened so they are restored from the log; each time, the memory that clearing
``Transactions.pending`` frees (tracemalloc) is divided by the count. Prints JSON.

    .venv/bin/python -m bench.txn_half_memory [--count 50000]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import tracemalloc

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.config import BrokerConfig
from chronoq.features.transactions import Transactions


def _held_per_half(txns: Transactions, count: int) -> float:
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    txns.pending.clear()
    gc.collect()
    return (full - tracemalloc.get_traced_memory()[0]) / count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=50_000)
    count = ap.parse_args().count
    tracemalloc.start()
    out = {"count": count}
    with tempfile.TemporaryDirectory() as data:
        cfg = BrokerConfig(data_dir=data, flush_policy="async", max_pending_transactions=max(count, 1))
        broker = Broker(cfg)
        txns = Transactions(broker)
        for start in range(0, count, 1000):
            halves = txns.half_messages([OutgoingMessage("orders", b"x" * 100)
                                         for _ in range(min(1000, count - start))])
            txns.accepted(broker.send_batch(halves, system=True), halves)
        del halves
        out["bytes_per_half_sent"] = round(_held_per_half(txns, count))
        broker.close()
        broker = Broker(cfg)
        txns = Transactions(broker)
        assert len(txns.pending) == count
        out["bytes_per_half_restored"] = round(_held_per_half(txns, count))
        broker.close()
    for key in ("bytes_per_half_sent", "bytes_per_half_restored"):
        print(json.dumps({"metric": f"txn_{key}", "value": out[key], "unit": "bytes", "count": count}))


if __name__ == "__main__":
    main()
