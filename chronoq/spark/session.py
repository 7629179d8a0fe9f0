"""A quiet local SparkSession for chronoq's own jobs (``chronoq audit``, examples, benchmarks, tests).

Settings from the PySpark notes: workers run this interpreter (``PYSPARK_PYTHON``), everything
binds to loopback with the UI off, logs are cut to errors, scratch files go to a temporary
directory (no ``metastore_db``/``derby.log``/``spark-warehouse`` in the working directory),
``-Xss8m`` avoids a StackOverflowError when a streaming query is stopped mid-batch.
An active session is reused as it is (its master and settings win).
"""

from __future__ import annotations

import os
import sys
import tempfile

LOG4J = """rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def local_session(master: str = "local[*]", app: str = "chronoq", scratch: str | None = None,
                  driver_memory: str = "1g", extra: dict | None = None):
    """Get the active SparkSession, or start one on ``master`` with the settings above."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        from chronoq.spark import register

        register(active)
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    scratch = scratch or tempfile.mkdtemp(prefix="chronoq-spark-")
    os.makedirs(scratch, exist_ok=True)
    log4j = os.path.join(scratch, "log4j2.properties")
    with open(log4j, "w") as fh:
        fh.write(LOG4J)
    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.memory", driver_memory)
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.local.dir", os.path.join(scratch, "local"))
               .config("spark.sql.warehouse.dir", os.path.join(scratch, "warehouse"))
               .config("spark.driver.extraJavaOptions",
                       f"-Xss8m -Dlog4j2.configurationFile=file:{log4j} -Dderby.system.home={scratch}"))
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from chronoq.spark import register

    register(spark)
    return spark
