"""Sharing a broker-wide limit out between connections. Pure.

Some limits count what all clients hold together (long polls parked: ``max_parked_polls``;
Telemetry streams: ``max_streams``). Refusing whatever comes once the limit is reached lets one
client that takes every place shut all others out. The rule both use instead: a newcomer from a
connection holding ``mine`` places takes one from the connection holding the most, if that one
holds at least two more (so the shares even out and never swap back and forth); otherwise the
newcomer is refused, its connection holding its share already.
"""

from __future__ import annotations

from typing import Mapping, Sized


def give_up_one(held: Mapping[str, Sized], peer: str) -> str | None:
    """The connection that gives a place up to a newcomer of ``peer`` (``held``: each connection's
    places), or None when none holds two more than ``peer`` does."""
    heaviest = max(held, key=lambda p: len(held[p]), default=None)
    if heaviest is None or len(held[heaviest]) < len(held.get(peer, ())) + 2:
        return None
    return heaviest
