"""Recurring schedules (issue 26 §3): named schedules that produce a message into a topic on a cron
expression or a fixed interval, in an IANA time zone. ``occurrences`` is the pure part (when a
schedule fires, DST rules, the catch-up policy); ``book`` is the durable state and the rounds that
hand occurrences to the timer as delayed messages. See docs/timers.md, "Recurring schedules"."""
