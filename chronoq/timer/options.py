"""The timer's settings (``TimerOptions``), from the broker configuration (``timer_*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TimerOptions:
    delay_levels: str
    max_delay_ms: int
    bucket_ms: int
    preload_ms: int
    wheel_slots: int
    wheel_slot_ms: int
    deliver_mode: str
    pending_max: int
    retry_backoff_ms: int
    retry_backoff_max_ms: int
    block_after_failures: int
    load_batch: int
    checkpoint_interval_ms: int
    recall_memory_ms: int
    prewrite_ms: int = 0
    burst_lead_ms: int = 0
    burst_lead_max_ms: int = 0

    @classmethod
    def from_config(cls, cfg) -> "TimerOptions":
        """Each field from the configuration key of the same name with ``timer_`` in front."""
        return cls(**{f.name: getattr(cfg, "timer_" + f.name) for f in fields(cls)})
