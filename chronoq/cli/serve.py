"""``chronoq serve``: run the broker in this process."""

from __future__ import annotations

import sys

import click

from chronoq.core import errors
from chronoq.core.config import load_config


@click.command()
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where data lives. Default ./chronoq-data (env CHRONOQ_DATA_DIR).")
@click.option("--port", type=int, default=None, help="gRPC port. Default 8081 (env CHRONOQ_PORT).")
@click.option("--host", default=None, help="Address to bind. Default 127.0.0.1 (env CHRONOQ_HOST).")
@click.option("--http-port", default=None,
              help="HTTP port (/metrics, console). Default 8082; 0: any free port; off: none "
                   "(env CHRONOQ_HTTP_PORT).")
@click.option("--http-host", default=None, help="Address the HTTP listener binds. Default 127.0.0.1 "
                                                "(env CHRONOQ_HTTP_HOST).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML config file (see docs/configuration.md).")
@click.option("--flush-policy", type=click.Choice(["sync", "async"]), default=None,
              help="sync (default): fsync before acknowledging; async: fsync every flush_interval_ms.")
@click.option("--quarantine", is_flag=True, default=None,
              help="On corruption in a sealed segment or mid-log, copy the damaged bytes to "
                   "quarantine/, mark them lost and start anyway (default: refuse to start).")
@click.option("--log-level", default=None, help="debug, info (default), warning, error (env CHRONOQ_LOG_LEVEL).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="text (default): time, level, logger, message; json: one object a line, for log shippers "
                   "(env CHRONOQ_LOG_FORMAT).")
@click.option("--replica-of", default=None, metavar="HOST:PORT",
              help="Run as a replica of the primary at HOST:PORT: follow its log, serve no clients "
                   "(env CHRONOQ_REPLICA_OF; docs/replication.md).")
@click.option("--rejoin", is_flag=True, default=None,
              help="With --replica-of: follow it even if this data directory was promoted to primary "
                   "(it truncates at the epoch boundary; env CHRONOQ_REJOIN).")
@click.option("--etcd-endpoints", default=None, metavar="HOST:PORT[,...]",
              help="Take this node's role from etcd and fail over automatically (env CHRONOQ_ETCD_ENDPOINTS; "
                   "docs/replication.md, \"Automatic failover with etcd\").")
@click.option("--cluster-name", default=None, help="With etcd: the cluster's name (default chronoq).")
@click.option("--group-name", default=None, help="With etcd: this broker group's name (default default).")
@click.option("--force-leader", is_flag=True, default=None,
              help="With etcd: lead even when not in the recorded in-sync set (an unclean promotion: what the "
                   "last primary acknowledged and this node lacks is lost).")
def serve(data_dir, port, host, http_port, http_host, config_file, flush_policy, quarantine, log_level,
          log_format, replica_of, rejoin, etcd_endpoints, cluster_name, group_name, force_leader) -> None:
    """Run the broker until SIGTERM or SIGINT."""
    try:
        cfg = load_config(config_file, overrides={
            "data_dir": data_dir, "port": port, "host": host, "http_port": http_port, "http_host": http_host,
            "flush_policy": flush_policy,
            "quarantine": quarantine, "log_level": log_level, "log_format": log_format,
            "replica_of": replica_of, "rejoin": rejoin, "etcd_endpoints": etcd_endpoints,
            "cluster_name": cluster_name, "group_name": group_name, "force_leader": force_leader,
        })
    except errors.ChronoqError as exc:
        raise click.UsageError(exc.message) from None
    from chronoq.server import logsetup
    from chronoq.server.runtime import run

    logsetup.configure(cfg.log_level, cfg.log_format)

    try:
        run(cfg)
    except errors.CorruptionError as exc:
        click.echo(f"chronoq: cannot start: {exc.message}", err=True)
        sys.exit(2)
    except errors.ChronoqError as exc:
        click.echo(f"chronoq: cannot start: {exc.message}", err=True)
        sys.exit(1)


