"""The broker: the facade that composes store, timer and POP (``broker.Broker``, the embedded API),
the committer that owns group commit, the dedupe window and the message trace buffer.

``from chronoq.broker import Broker, OutgoingMessage`` is the embedded API's import; the names are
resolved on first use so that importing a module of this package does not open the whole broker.
"""

_PUBLIC = {"Broker", "OutgoingMessage"}


def __getattr__(name: str):
    if name in _PUBLIC:
        from chronoq.broker import broker
        return getattr(broker, name)
    raise AttributeError(f"module 'chronoq.broker' has no attribute {name!r}")
