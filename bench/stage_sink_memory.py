"""What one staging sink and one published batch id cost the broker (what sets the defaults of
max_stage_sinks and max_stage_published_ids, chronoq/features/stagesinks.py): ``--sinks`` sinks
publish one batch each (sink ids like the Spark sink's ``job:<uuid>``), then one sink publishes
``--ids`` batch ids each above a gap. Memory is what forgetting them frees (tracemalloc); the
state file's size and the time of one forced checkpoint are taken with them held. Prints JSON.

    .venv/bin/python -m bench.stage_sink_memory [--sinks 10000] [--ids 100000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import tracemalloc

from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig
from chronoq.features.staging import STATE_FILE, Staging


def _freed(st: Staging) -> int:
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    st.sinks.by_name.clear()
    st.sinks.ids_held = 0
    gc.collect()
    return full - tracemalloc.get_traced_memory()[0]


def _checkpoint(st: Staging, path: str) -> tuple[int, float]:
    t = time.perf_counter()
    st.checkpoint(force=True)
    return os.path.getsize(path), time.perf_counter() - t


def _run(args, out: dict, traced: bool) -> None:
    """One pass: with ``traced``, the memory figures (tracemalloc on); without, the state file's
    size and the checkpoint times (tracemalloc slows ``json.dumps`` several times)."""
    if traced:
        tracemalloc.start()
    with tempfile.TemporaryDirectory() as data:
        cfg = BrokerConfig(data_dir=data, flush_policy="async", max_stage_sinks=args.sinks + 1,
                           max_stage_published_ids=args.ids + 1)
        broker = Broker(cfg)
        st = Staging(broker)
        path = os.path.join(data, STATE_FILE)
        for i in range(args.sinks):
            for _ in st.publish(f"job:{i:08x}-0000-4000-8000-000000000000", 0, []).steps(st):
                pass
        if traced:
            out["bytes_per_sink"] = round(_freed(st) / args.sinks)
        else:
            size, secs = _checkpoint(st, path)
            out.update(state_file_bytes_per_sink=round(size / args.sinks), checkpoint_ms_sinks=round(secs * 1000, 1))
            st.sinks.by_name.clear()
        for _ in st.publish("gappy", 0, []).steps(st):
            pass
        used_ms = st.sinks.get("gappy").used_ms
        for k in range(args.ids):  # every other id above 2**31: none folds into ``below``
            st.sinks.add("gappy", 2**31 + 2 * k, used_ms)
        assert st.sinks.ids_held == args.ids
        if traced:
            out["bytes_per_id"] = round(_freed(st) / args.ids, 1)
        else:
            size, secs = _checkpoint(st, path)
            out.update(state_file_bytes_per_id=round(size / args.ids, 1), checkpoint_ms_ids=round(secs * 1000, 1))
        broker.close()
    if traced:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sinks", type=int, default=10_000)
    ap.add_argument("--ids", type=int, default=100_000)
    args = ap.parse_args()
    out: dict = {"sinks": args.sinks, "ids": args.ids}
    _run(args, out, traced=False)
    _run(args, out, traced=True)
    for key, value in out.items():
        if key not in ("sinks", "ids"):
            unit = "ms" if key.startswith("checkpoint_ms") else "bytes"
            print(json.dumps({"metric": f"stage_{key}", "value": value, "unit": unit, "sinks": args.sinks,
                              "ids": args.ids}))


if __name__ == "__main__":
    main()
