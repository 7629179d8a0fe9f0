"""Delayed delivery: timer messages (``deliver_at_ms``), delay levels, recall and reschedule.

Pure core (no I/O, explicit ``now_ms``): ``core.delay_levels`` (level table), ``wheel`` (hashed
timing wheel), ``lanes`` (bounded delivery queues: flow control, back-off, blocking), ``handle``
(recall handles), ``deliverytime`` (delivery-time rules, the seconds/milliseconds quirk),
``copies`` (records the timer writes), ``buckets`` (one bucket's state), ``stats`` (lateness),
``options`` (``TimerOptions``). Format: ``schedlog`` (schedule-log files and the append journal,
layout at its top), ``checkpoint`` (``checkpoint.json``). Shell: ``schedfiles`` (the files' I/O)
and ``service`` (``TimerService``, owned by ``Broker``), whose jobs are one module each:
``absorb``, ``replay``, ``bucketlife``, ``delivery``, ``deadline``, ``recall``, ``checkpoint``,
``horizon`` (see the table in ``service``). ``digest``: a comparable view of what is pending.
User documentation: docs/timers.md.
"""
