"""chronoq: a durable message broker for delayed and scheduled messages."""

__version__ = "0.1.0"
