"""chronoq on Apache Spark: the ``chronoq`` PySpark data source and the delivery audit.

    import chronoq.spark
    chronoq.spark.register(spark)          # once per SparkSession
    df = (spark.read.format("chronoq").option("endpoints", "127.0.0.1:8081")
          .option("topic", "orders").load())

Needs the ``spark`` extra (``pip install 'chronoq[spark]'``: PySpark 4.3, pyarrow) and Java 17.
Options, schema, offsets and the exactly-once guarantee: docs/spark.md.
"""

from __future__ import annotations

NAME = "chronoq"


def register(spark) -> None:
    """Register the ``chronoq`` data source with ``spark`` (a SparkSession). Idempotent."""
    from chronoq.spark.source import ChronoqDataSource

    spark.dataSource.register(ChronoqDataSource)


__all__ = ["NAME", "register"]
