"""Broker configuration: defaults, a TOML file, ``CHRONOQ_*`` environment variables, flags.

Precedence, lowest first: built-in defaults < config file < environment < command-line flags.
Every key is listed in ``docs/configuration.md`` with its default; unknown keys are an error so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from chronoq.core import acl, console_settings, errors
from chronoq.core.delay_levels import DelayLevels

ENV_PREFIX = "CHRONOQ_"
# A held copy hides everything behind it in its queue until its due time: keep the lead short.
TIMER_PREWRITE_MAX_MS = 1000
# The longest lead of a burst (``timer_burst_lead_max_ms``): a restart looks back 15 s by entry
# time for held copies still in the future (``StoreOptions.hold_window_ms``), and a lead stays
# 5 s inside that for the wall clock (``chronoq.timer.burstlead.check_hold_window``).
TIMER_BURST_LEAD_LIMIT_MS = 10_000
# The dedupe window maps 44 bytes per entry up front (virtual memory; RSS as it fills).
DEDUPE_MAX_ENTRIES_LIMIT = 50_000_000


@dataclass
class BrokerConfig:
    data_dir: str = "./chronoq-data"
    host: str = "127.0.0.1"
    port: int = 8081
    # The HTTP listener (chronoq.server.http: /metrics, /healthz, the web console; docs/metrics.md).
    # http_port 0 picks a free port (announced in the "chronoq is ready" line); negative: no listener.
    http_host: str = "127.0.0.1"
    http_port: int = 8082
    # Connections the HTTP listener holds at once (chronoq.server.http, where the default is
    # explained); one more is answered 503 and closed. They come out of the open-files reserve.
    http_max_connections: int = 64
    # An HTTP connection with no request under way (or a request's headers not all in) this long is closed.
    http_idle_timeout_ms: int = 30_000
    # Address clients are told to dial (the route's broker endpoint); default host:port.
    advertised_address: str = ""
    broker_name: str = "chronoq"
    flush_policy: str = "sync"  # "sync": fsync before acking; "async": fsync every flush_interval_ms
    flush_interval_ms: int = 100
    segment_bytes: int = 1 << 30
    cq_entries_per_file: int = 300_000
    cq_open_files: int = 0  # consume-queue files open at once (store/fdbudget.py); 0: a quarter of RLIMIT_NOFILE
    max_body_bytes: int = 4 * 1024 * 1024
    auto_create_topics: bool = True
    default_queues: int = 4
    max_queues: int = 1024
    max_topics: int = 10_000  # user topics (clients create them: auto_create_topics)
    max_groups: int = 10_000  # consumer groups (clients create them by receiving)
    max_subscriptions: int = 100_000  # group/topic pairs whose reading state the POP service keeps
    dedupe_window_ms: int = 60_000
    dedupe_max_entries: int = 200_000
    checkpoint_interval_ms: int = 1000
    retention_max_age_hours: float = 72.0
    retention_max_bytes: int = 0  # 0: no size limit
    retention_interval_s: float = 60.0
    verify_extra_segments: int = 0
    quarantine: bool = False
    log_level: str = "info"
    # "text" (a line: ISO 8601 UTC time, level, logger, message) or "json" (one object a line, for
    # log shippers): chronoq.server.logsetup.
    log_format: str = "text"
    # Transactions: an unresolved half message is checked with its producer after this long,
    # then every txn_check_interval_ms, at most txn_max_checks times; then it is rolled back.
    txn_check_after_ms: int = 6_000
    txn_check_interval_ms: int = 10_000
    txn_max_checks: int = 15
    # Pending (unresolved) half messages held at once; more: TOO_MANY_REQUESTS. Each costs 280-310
    # bytes of memory and a look in every check pass (chronoq.features.transactions).
    max_pending_transactions: int = 200_000
    # Delayed delivery (chronoq.timer; docs/timers.md).
    timer_delay_levels: str = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
    timer_max_delay_ms: int = 730 * 86_400_000  # two years
    timer_bucket_ms: int = 60_000
    timer_preload_ms: int = 60_000
    timer_wheel_slots: int = 4096
    timer_wheel_slot_ms: int = 16
    timer_deliver_mode: str = "async"  # "async": group writes, one fsync per group; "sync": one each
    timer_pending_max: int = 2000
    # Timer copies are written this long before their due time and held hidden until it, so the
    # commit-log fsync is done when they fall due (0: written at the due time, visible after fsync).
    timer_prewrite_ms: int = 50
    # A burst (timers due faster than 20,000/s over this window) is written at least this far ahead
    # instead (0: never; at most TIMER_PREWRITE_MAX_MS; only with timer_prewrite_ms > 0) ...
    timer_burst_lead_ms: int = 1000
    # ... and up to this far, as long as its copies take to write (chronoq.timer.burstlead; at most
    # TIMER_BURST_LEAD_LIMIT_MS; equal to timer_burst_lead_ms: a fixed lead).
    timer_burst_lead_max_ms: int = 10_000
    timer_retry_backoff_ms: int = 100
    timer_retry_backoff_max_ms: int = 10_000
    timer_block_after_failures: int = 3
    timer_load_batch: int = 1000  # per tick: ~4 ms of parsing, so loading a big bucket ahead never holds due work long
    timer_checkpoint_interval_ms: int = 5000
    timer_recall_memory_ms: int = 7 * 86_400_000
    # Message life trace for `chronoq audit` (chronoq.broker.trace; docs/spark.md): buffered events are
    # written to the system topic CHRONOQ_TRACE every trace_flush_ms.
    trace_enabled: bool = True
    trace_flush_ms: int = 1000
    # Staged publish (chronoq.features.staging): rows staged but neither published nor aborted are
    # discarded after this long, so an abandoned Spark job does not pin the commit log.
    stage_ttl_ms: int = 86_400_000
    # Staged chunks held at once (each ~190 bytes of memory); more: TOO_MANY_REQUESTS.
    max_staged_chunks: int = 200_000
    # Staging sinks (writers' sink ids: one per streaming query or df.write job) remembered at once,
    # and batch ids above a gap held by all of them (chronoq.features.stagesinks, where the costs
    # are); a Publish that would add one past either: TOO_MANY_REQUESTS.
    max_stage_sinks: int = 10_000
    max_stage_published_ids: int = 100_000
    # Which gRPC server serves the port: "chronoq" (chronoq.server.h2server, on the event loop)
    # or "grpcio" (grpc.aio's server: several threads per call, ~5x the CPU per call on small VMs).
    grpc_server: str = "chronoq"
    # HTTP/2 front end limits (chronoq.server.h2limits, where each default is explained;
    # docs/security.md "HTTP/2 limits"). The attack budgets there are not configuration.
    h2_max_connections: int = 1000          # open connections, broker-wide
    h2_max_concurrent_streams: int = 250    # per connection (SETTINGS_MAX_CONCURRENT_STREAMS)
    h2_preface_timeout_ms: int = 10_000     # the client preface and first SETTINGS must come by then
    h2_idle_timeout_ms: int = 300_000       # a connection with no open stream this long is closed
    h2_max_header_list_bytes: int = 65_536  # decoded request headers, 32 bytes per field counted
    # Security and limits (docs/security.md). TLS is on when both PEM paths are set.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    max_parked_polls: int = 10_000      # long polls waiting at once; more: TOO_MANY_REQUESTS
    max_streams_per_client: int = 8     # open Telemetry streams per x-mq-client-id
    max_streams: int = 10_000           # open Telemetry streams in all
    disk_reserve_bytes: int = 64 * 1024 * 1024  # sends are refused below this much free space (0: off)
    disk_check_interval_ms: int = 500   # free space is looked up at most this often
    # Answer budget (chronoq/server/answers.py; docs/security.md, "Answer budget"): bytes of
    # receive answers encoded but not yet taken by the peer (its flow-control window or a full
    # socket), per connection and broker-wide; beyond it receives answer TOO_MANY_REQUESTS (or a
    # smaller batch). An answer not taken within answer_send_timeout_ms ends its call and its
    # messages go back to the queue at once.
    answer_budget_per_connection: int = 16 * 1024 * 1024
    answer_budget_total: int = 256 * 1024 * 1024
    answer_send_timeout_ms: int = 10_000
    # Push consumers (auto_renew receives; chronoq/pop/renew.py, docs/rocketmq.md): messages stay
    # invisible in slices of push_invisible_ms, renewed until acked, nacked, the client is gone, or
    # auto_renew_max_ms after the receive (0: no renewal, one slice only).
    push_invisible_ms: int = 60_000
    auto_renew_max_ms: int = 3 * 3600 * 1000
    # `chronoq serve` lowers its nice value by this much at start, when the OS allows it (root or
    # CAP_SYS_NICE). 0 (default): unchanged, the service manager's (systemd's Nice=) stays in force;
    # a process that renices itself surprises the operators who set it. On a host whose CPUs are
    # shared with busy clients a boost trims timer lateness's tail a little (docs/timers.md).
    priority_boost: int = 0
    # Replication (chronoq.replication; docs/replication.md). ``replica_of`` "host:port": this broker is
    # a replica of that primary (empty: a primary). The replica's pulls are signed with these
    # credentials when the primary has access control on (an admin user there).
    replica_of: str = ""
    # A primary's acknowledgements: "async" (after its own fsync) or "sync" (also after a replica
    # reported the record durable; none in sync within replication_sync_timeout_ms: the send is
    # answered SLAVE_PERSISTENCE_TIMEOUT, the record stays stored here).
    replication: str = "async"
    replication_sync_timeout_ms: int = 5000
    # Under sync, a send no replica reported durable in time: "refuse" (default: answered
    # SLAVE_PERSISTENCE_TIMEOUT, never a silent loss of the guarantee) or "async" (answered OK,
    # durable on this primary alone, counted in chronoq_replication_sync_fallbacks_total).
    replication_sync_fallback: str = "refuse"
    replication_access_key: str = ""
    replication_secret_key: str = field(default="", repr=False)
    # The replica's pulls (and the calls a node passes on to a primary) over TLS, for a primary
    # that serves TLS (tls_cert_file): ``replication_tls`` trusts the system's roots,
    # ``replication_tls_ca_file`` the CA in that PEM file (setting it turns TLS on).
    replication_tls: bool = False
    replication_tls_ca_file: str = ""
    # Rejoining (docs/replication.md, "Rejoining after a failover"): a replica cuts at most this
    # much of its log at an epoch boundary (0: never cuts; refused instead). ``rejoin``: a data
    # directory that was promoted (role.json) follows ``replica_of`` only when this is set
    # (``--rejoin``); otherwise it serves as the primary it became.
    rejoin_max_truncate_bytes: int = 256 << 20
    rejoin: bool = False
    # Automatic failover through etcd (chronoq.replication.etcd; docs/replication.md, "Automatic
    # failover with etcd"). ``etcd_endpoints`` "host:port,host:port" (empty: off, nothing changes):
    # the node's role comes from etcd, the primary holds a leader key on a lease of ``lease_ttl_ms``
    # (rounded up to whole seconds; etcd grants at least its own minimum, 2 s by default) and
    # acknowledges nothing once it may have lost it. Keys live under /chronoq/<cluster>/<group>/.
    etcd_endpoints: str = ""
    # etcd over TLS and as a user (docs/replication.md, "etcd with TLS and a user"): ``etcd_ca_file``
    # (PEM) verifies etcd's certificate; ``etcd_cert_file`` + ``etcd_key_file`` present this node's
    # (etcd's --client-cert-auth); either turns TLS on. ``etcd_user`` + ``etcd_password`` when etcd's
    # authentication is on (CHRONOQ_ETCD_PASSWORD keeps the password out of the file).
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""
    etcd_password: str = field(default="", repr=False)
    cluster_name: str = "chronoq"
    group_name: str = "default"
    lease_ttl_ms: int = 5000
    # Start as the primary even when this node is not in the recorded in-sync set (an unclean
    # promotion: what the last primary acknowledged and this node lacks is lost). Usually a flag.
    force_leader: bool = False
    # Tables of the config file ([groups.*], [auth], ...). Not in the repr: [auth] holds secrets.
    extra: dict = field(default_factory=dict, repr=False)

    def validate(self) -> "BrokerConfig":
        if self.flush_policy not in ("sync", "async"):
            raise errors.ClientError(f"flush_policy must be 'sync' or 'async', not {self.flush_policy!r}")
        if not 1 <= self.port <= 65535:
            raise errors.ClientError(f"port {self.port} is out of range 1..65535")
        if self.http_port > 65535:
            raise errors.ClientError(f"http_port {self.http_port} is out of range (0: any free port, "
                                     "negative: no HTTP listener)")
        if not 1 <= self.http_max_connections <= 10_000:
            raise errors.ClientError(f"http_max_connections must be from 1 to 10000, not {self.http_max_connections}")
        if not 100 <= self.http_idle_timeout_ms <= 86_400_000:
            raise errors.ClientError(f"http_idle_timeout_ms must be from 100 to 86400000, not {self.http_idle_timeout_ms}")
        if self.cq_open_files != 0 and not 16 <= self.cq_open_files <= 1_000_000:
            raise errors.ClientError(f"cq_open_files must be 0 (automatic) or from 16 to 1000000, not {self.cq_open_files}")
        if not 1 <= self.max_topics <= 10_000_000:
            raise errors.ClientError(f"max_topics must be from 1 to 10000000, not {self.max_topics}")
        if not 1 <= self.max_groups <= 10_000_000:
            raise errors.ClientError(f"max_groups must be from 1 to 10000000, not {self.max_groups}")
        if not 1 <= self.max_staged_chunks <= 10_000_000:
            raise errors.ClientError(f"max_staged_chunks must be from 1 to 10000000, not {self.max_staged_chunks}")
        if not 1 <= self.max_stage_sinks <= 10_000_000:
            raise errors.ClientError(f"max_stage_sinks must be from 1 to 10000000, not {self.max_stage_sinks}")
        if not 1 <= self.max_stage_published_ids <= 100_000_000:
            raise errors.ClientError(f"max_stage_published_ids must be from 1 to 100000000, "
                                     f"not {self.max_stage_published_ids}")
        if not 1 <= self.max_pending_transactions <= 10_000_000:
            raise errors.ClientError(f"max_pending_transactions must be from 1 to 10000000, "
                                     f"not {self.max_pending_transactions}")
        if not 1 <= self.max_subscriptions <= 100_000_000:
            raise errors.ClientError(f"max_subscriptions must be from 1 to 100000000, not {self.max_subscriptions}")
        if not 1 <= self.default_queues <= self.max_queues <= 65535:
            raise errors.ClientError("need 1 <= default_queues <= max_queues <= 65535")
        if not 1 <= self.max_body_bytes <= 64 * 1024 * 1024:
            raise errors.ClientError("max_body_bytes must be between 1 and 64 MiB")
        if self.segment_bytes < 64 * 1024:
            raise errors.ClientError("segment_bytes must be at least 64 KiB")
        if not 0 <= self.dedupe_max_entries <= DEDUPE_MAX_ENTRIES_LIMIT:  # (44 bytes each: chronoq.broker.dedupe)
            raise errors.ClientError(f"dedupe_max_entries must be 0 to {DEDUPE_MAX_ENTRIES_LIMIT:,}, "
                                     f"not {self.dedupe_max_entries}")
        if self.flush_interval_ms <= 0 or self.checkpoint_interval_ms <= 0 or self.trace_flush_ms <= 0 \
                or self.stage_ttl_ms <= 0:
            raise errors.ClientError("intervals must be positive")
        self._validate_timer()
        self._validate_h2()
        self._validate_security()
        self._validate_answer_budget()
        # [console] (chronoq.core.console_settings): checked here, at load, so a typo stops `chronoq
        # serve` before it opens anything, not later when the HTTP listener starts.
        console_settings.parse(self.extra.get("console"))
        if self.log_format not in ("text", "json"):
            raise errors.ClientError(f"log_format must be 'text' or 'json', not {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise errors.ClientError(f"log_level must be debug, info, warning or error, not {self.log_level!r}")
        self._validate_replication()
        if not 0 <= self.priority_boost <= 20:
            raise errors.ClientError(f"priority_boost must be 0 to 20 nice steps, not {self.priority_boost}")
        if not 1000 <= self.push_invisible_ms <= 12 * 3600 * 1000:
            raise errors.ClientError(f"push_invisible_ms must be 1000 ms to 12 h, not {self.push_invisible_ms}")
        if not 0 <= self.auto_renew_max_ms <= 24 * 3600 * 1000:
            raise errors.ClientError(f"auto_renew_max_ms must be 0 to 24 h, not {self.auto_renew_max_ms}")
        return self

    def _validate_replication(self) -> None:
        if self.replication not in ("async", "sync"):
            raise errors.ClientError(f"replication must be 'async' or 'sync', not {self.replication!r}")
        if self.replication_sync_fallback not in ("refuse", "async"):
            raise errors.ClientError("replication_sync_fallback must be 'refuse' or 'async', not "
                                     f"{self.replication_sync_fallback!r}")
        if not 100 <= self.replication_sync_timeout_ms <= 600_000:
            raise errors.ClientError("replication_sync_timeout_ms must be 100 ms to 10 min, not "
                                     f"{self.replication_sync_timeout_ms}")
        if self.rejoin_max_truncate_bytes < 0:
            raise errors.ClientError(f"rejoin_max_truncate_bytes must be >= 0, not {self.rejoin_max_truncate_bytes}")
        self._validate_etcd()
        if not self.replica_of:
            return
        host, sep, port = self.replica_of.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise errors.ClientError(f"replica_of must be host:port of the primary, not {self.replica_of!r}")
        if self.replica_of in (f"{self.host}:{self.port}", self.endpoint):
            raise errors.ClientError(f"replica_of {self.replica_of} is this broker's own address: a replica "
                                     "follows another broker, its primary")

    def _validate_etcd(self) -> None:
        for name in ("cluster_name", "group_name"):
            value = getattr(self, name)
            if not value or not all(c.isalnum() or c in "-_." for c in value):
                raise errors.ClientError(f"{name} must be letters, digits, '-', '_' or '.', not {value!r}")
        if not 1000 <= self.lease_ttl_ms <= 300_000:
            raise errors.ClientError(f"lease_ttl_ms must be 1000 ms to 5 min, not {self.lease_ttl_ms}")
        for endpoint in self.etcd_list:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise errors.ClientError(f"etcd_endpoints must be host:port[,host:port...], not {self.etcd_endpoints!r}")
        if self.etcd_list and self.replica_of:
            raise errors.ClientError("replica_of and etcd_endpoints exclude each other: with etcd a node's role "
                                     "(and its primary) comes from etcd")
        if bool(self.etcd_cert_file) != bool(self.etcd_key_file):
            raise errors.ClientError("etcd_cert_file and etcd_key_file go together (a client certificate and its key)")
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise errors.ClientError("etcd_user and etcd_password go together")
        if self.force_leader and not self.etcd_list:
            raise errors.ClientError("force_leader needs etcd_endpoints (without etcd, promote a replica with "
                                     "`chronoq promote`)")

    @property
    def etcd_list(self) -> list[str]:
        """``etcd_endpoints`` split (empty: no etcd)."""
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    def replication_connection(self) -> dict:
        """How this node reaches a primary (``chronoq.replication.client.ReplicationClient``'s keywords)."""
        return dict(access_key=self.replication_access_key, secret_key=self.replication_secret_key,
                    tls=self.replication_tls, tls_ca_file=self.replication_tls_ca_file)

    def _validate_security(self) -> None:
        if self.replication_tls_ca_file and not os.path.isfile(self.replication_tls_ca_file):
            raise errors.ClientError(f"replication_tls_ca_file {self.replication_tls_ca_file!r} is not a file")
        if self.grpc_server not in ("chronoq", "grpcio"):
            raise errors.ClientError(f"grpc_server must be 'chronoq' or 'grpcio', not {self.grpc_server!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise errors.ClientError("TLS needs both tls_cert_file and tls_key_file (PEM), or neither")
        for name in ("max_parked_polls", "max_streams_per_client", "max_streams", "disk_check_interval_ms"):
            if getattr(self, name) <= 0:
                raise errors.ClientError(f"{name} must be positive, not {getattr(self, name)}")
        if self.disk_reserve_bytes < 0:
            raise errors.ClientError(f"disk_reserve_bytes may not be negative, not {self.disk_reserve_bytes}")
        acl.from_config(self.extra.get("auth"))  # raises on a malformed [auth] table

    def open_replica_warning(self) -> str | None:
        """What to warn of at start for a node holding replication credentials without access
        control of its own (None: nothing): its primary has it on, this node answers anyone."""
        if self.replication_access_key and acl.from_config(self.extra.get("auth")) is None:
            return ("replication_access_key is set (the primary has access control on) but this node's [auth] "
                    "is off: anyone reaching it may promote it, and once promoted it serves with no access "
                    "control; give it the primary's [auth] table")
        return None

    def _validate_answer_budget(self) -> None:
        if not 0 < self.answer_budget_per_connection <= self.answer_budget_total:
            raise errors.ClientError("need 0 < answer_budget_per_connection <= answer_budget_total, not "
                                     f"{self.answer_budget_per_connection} and {self.answer_budget_total}")
        if not 100 <= self.answer_send_timeout_ms <= 3_600_000:
            raise errors.ClientError(f"answer_send_timeout_ms must be 100 ms to 1 h, not {self.answer_send_timeout_ms}")

    def _validate_h2(self) -> None:
        for name in ("h2_max_connections", "h2_max_concurrent_streams", "h2_preface_timeout_ms",
                     "h2_idle_timeout_ms"):
            if getattr(self, name) <= 0:
                raise errors.ClientError(f"{name} must be positive, not {getattr(self, name)}")
        if not 4096 <= self.h2_max_header_list_bytes <= 16 << 20:
            raise errors.ClientError(f"h2_max_header_list_bytes must be 4 KiB to 16 MiB, not "
                                     f"{self.h2_max_header_list_bytes}")

    def _validate_timer(self) -> None:
        DelayLevels.parse(self.timer_delay_levels)
        if self.timer_deliver_mode not in ("sync", "async"):
            raise errors.ClientError(f"timer_deliver_mode must be 'sync' or 'async', not {self.timer_deliver_mode!r}")
        if self.timer_wheel_slots < 1 or self.timer_wheel_slots & (self.timer_wheel_slots - 1):
            raise errors.ClientError(f"timer_wheel_slots must be a power of two, not {self.timer_wheel_slots}")
        positive = ("timer_max_delay_ms", "timer_bucket_ms", "timer_wheel_slot_ms", "timer_pending_max",
                    "timer_retry_backoff_ms", "timer_block_after_failures", "timer_load_batch",
                    "timer_checkpoint_interval_ms")
        for name in positive:
            if getattr(self, name) <= 0:
                raise errors.ClientError(f"{name} must be positive, not {getattr(self, name)}")
        if not 0 <= self.timer_prewrite_ms <= TIMER_PREWRITE_MAX_MS:
            raise errors.ClientError(
                f"timer_prewrite_ms must be between 0 and {TIMER_PREWRITE_MAX_MS}, not {self.timer_prewrite_ms}")
        if not 0 <= self.timer_burst_lead_ms <= TIMER_PREWRITE_MAX_MS:
            raise errors.ClientError(
                f"timer_burst_lead_ms must be between 0 and {TIMER_PREWRITE_MAX_MS}, not {self.timer_burst_lead_ms}")
        if not self.timer_burst_lead_ms <= self.timer_burst_lead_max_ms <= TIMER_BURST_LEAD_LIMIT_MS:
            raise errors.ClientError(
                f"timer_burst_lead_max_ms must be between timer_burst_lead_ms ({self.timer_burst_lead_ms}) and "
                f"{TIMER_BURST_LEAD_LIMIT_MS} (the store's 15 s hold window less 5 s), not "
                f"{self.timer_burst_lead_max_ms}")
        if self.timer_preload_ms < 0 or self.timer_recall_memory_ms < 0:
            raise errors.ClientError("timer_preload_ms and timer_recall_memory_ms may not be negative")
        if self.timer_retry_backoff_max_ms < self.timer_retry_backoff_ms:
            raise errors.ClientError("timer_retry_backoff_max_ms must be at least timer_retry_backoff_ms")

    def delay_levels_ms(self) -> tuple[int, ...]:
        """``timer_delay_levels`` parsed: the delay of level 1, 2, ... in ms. The timer's delay
        levels and POP's retry back-off (``chronoq.pop.names``) both use this table."""
        return DelayLevels.parse(self.timer_delay_levels).delays_ms

    @property
    def endpoint(self) -> str:
        return self.advertised_address or f"{self.host}:{self.port}"


_FIELDS = {f.name: f for f in fields(BrokerConfig) if f.name != "extra"}
# The config file's tables besides [broker] (kept in ``extra``, each checked by its reader).
TABLES = {"console": "[console]", "auth": "[auth]", "groups": "[groups.<name>]"}


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELDS[name].type
    if isinstance(value, str):
        text = value.strip()
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise errors.ClientError(f"{name}: expected true/false, got {value!r}")
        if name == "http_port" and text.lower() == "off":
            return -1  # CHRONOQ_HTTP_PORT=off / --http-port off: no HTTP listener
        if kind == "int":
            try:
                return int(text.replace("_", ""))
            except ValueError:
                raise errors.ClientError(f"{name}: expected an integer, got {value!r}") from None
        if kind == "float":
            try:
                return float(text)
            except ValueError:
                raise errors.ClientError(f"{name}: expected a number, got {value!r}") from None
        return value
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise errors.ClientError(f"{name}: expected an integer, got {value!r}")
    if kind == "float" and not isinstance(value, (int, float)):
        raise errors.ClientError(f"{name}: expected a number, got {value!r}")
    if kind == "bool" and not isinstance(value, bool):
        raise errors.ClientError(f"{name}: expected true/false, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise errors.ClientError(f"{name}: expected a string, got {value!r}")
    return value


def _apply(cfg: BrokerConfig, values: Mapping[str, Any], source: str) -> BrokerConfig:
    changes = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise errors.ClientError(f"unknown setting {key!r} in {source}")
        changes[name] = _coerce(name, value)
    return dataclasses.replace(cfg, **changes)


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> BrokerConfig:
    cfg = BrokerConfig()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise errors.ClientError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise errors.ClientError(f"config file {path} is not valid TOML: {exc}") from None
        extra = {k: v for k, v in data.items() if isinstance(v, dict) and k != "broker"}
        unknown = sorted(set(extra) - set(TABLES))
        if unknown:  # a misspelt table's settings (and its mistakes) would go unread
            raise errors.ClientError(f"unknown table(s) {', '.join(f'[{t}]' for t in unknown)} in {path}; the "
                                     f"config file takes [broker], {', '.join(TABLES.values())} "
                                     "(docs/configuration.md)")
        flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
        flat.update(data.get("broker", {}))
        cfg = _apply(cfg, flat, path)
        cfg.extra = extra
    env = os.environ if env is None else env
    from_env = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
                if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() in _FIELDS}
    cfg = _apply(cfg, from_env, "the environment")
    cfg = _apply(cfg, {k: v for k, v in (overrides or {}).items() if v is not None}, "the command line")
    return cfg.validate()
