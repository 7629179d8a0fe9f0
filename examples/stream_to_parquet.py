"""Consume a chronoq topic into Parquet, exactly once.

The ``chronoq`` source reads by (queue, offset) and keeps its position only in Spark's
checkpoint, and Spark's file sink commits each micro-batch once (its ``_spark_metadata`` log), so
a query stopped, killed or restarted at any point writes every message exactly once: restart it
with the same ``--checkpoint``. Readers of the output must read it with Spark (which honours the
sink's log), not by listing the files.

    python examples/stream_to_parquet.py --endpoint 127.0.0.1:8081 --topic orders \\
        --output /data/orders --checkpoint /data/orders-ckpt                  # runs until Ctrl-C
    python examples/stream_to_parquet.py ... --available-now                  # drain, then stop
"""

from __future__ import annotations

import argparse
import sys


def start(spark, endpoint: str, topic: str, output: str, checkpoint: str, *, available_now: bool = False,
          max_per_trigger: int | None = None, starting: str = "earliest"):
    """Start the query; returns the ``StreamingQuery``."""
    import chronoq.spark

    chronoq.spark.register(spark)
    reader = (spark.readStream.format("chronoq").option("endpoints", endpoint).option("topic", topic)
              .option("startingOffsets", starting))
    if max_per_trigger:
        reader = reader.option("maxRecordsPerTrigger", str(max_per_trigger))
    writer = (reader.load().writeStream.format("parquet").option("path", output)
              .option("checkpointLocation", checkpoint).queryName(f"chronoq-{topic}-to-parquet"))
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="1 second")
    return writer.start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="127.0.0.1:8081")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--available-now", action="store_true", help="read what is there now, then stop")
    ap.add_argument("--max-per-trigger", type=int, default=None)
    ap.add_argument("--starting-offsets", default="earliest")
    ap.add_argument("--master", default="local[*]")
    args = ap.parse_args(argv)
    from chronoq.spark.session import local_session

    spark = local_session(args.master, app="chronoq-stream-to-parquet")
    query = start(spark, args.endpoint, args.topic, args.output, args.checkpoint,
                  available_now=args.available_now, max_per_trigger=args.max_per_trigger,
                  starting=args.starting_offsets)
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
