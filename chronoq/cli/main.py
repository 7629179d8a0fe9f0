"""The ``chronoq`` command line: ``serve`` runs the broker; the rest talk to one over gRPC.

``topic`` and ``group`` use chronoq's own ``chronoq.v1.Admin`` service; ``send`` and ``receive``
use ``apache.rocketmq.v2.MessagingService`` through ``chronoq.client.client``. Every remote command takes
``--endpoint`` (env ``CHRONOQ_ENDPOINT``), ``--timeout`` and ``--json``, prints a table for people
or one JSON document for scripts, and exits with a documented status (docs/cli.md):

    0  done
    1  the broker refused the request (bad name, unknown group, ...); stderr names the code
    2  bad usage, caught before anything was sent (click's own status)
    3  no answer: the broker is unreachable, timed out, or is not chronoq
    4  ``message recall``/``reschedule``: answered, but the message was not changed
       (already delivered, already cancelled, or not found); the outcome says which.
       ``message show``: nothing with that id or key in the windows searched
    5  ``audit`` only: the audit found early deliveries or lost messages

Names and values are checked by the broker, the one authority on them; the CLI checks only what
it must parse itself (endpoint, ``k=v`` properties, the body source).
"""

from __future__ import annotations

import click

from chronoq.cli import (audit, cluster, dlq, groups, message, placement, render, schedule, send_receive, serve, stats,
                         timers, topics)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="chronoq")
def main() -> None:
    """chronoq: a durable broker for delayed and scheduled messages."""
    render.whole_writes()


for command in (serve.serve, topics.topic, groups.group, send_receive.send, send_receive.receive, timers.timers,
                stats.stats, message.message, audit.audit, schedule.schedule, dlq.dlq,
                cluster.cluster, cluster.promote):
    main.add_command(command)
for command in (placement.groups, placement.drain, placement.remove_group):  # a cluster of broker groups (docs/cluster.md)
    cluster.cluster.add_command(command)
topics.topic.add_command(placement.add_queues)
