"""Consumer-group settings and the file that keeps them.

``groups.json`` in the data directory (written whole by ``fsutil.write_json``: temp file, fsync,
rename)::

    {"version": 1, "groups": {"<group>": {"fifo": <bool>, "max_attempts": <int>}}}

A group is created with the defaults the first time it receives (or when configured); the
retry back-off table is not saved: every group takes the broker's ``timer_delay_levels`` at
start, so a restart with another table follows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from chronoq.core import errors, fsutil, validate
from chronoq.pop import names
from chronoq.pop.names import DEFAULT_MAX_ATTEMPTS

GROUPS_FILE = "groups.json"
GROUPS_VERSION = 1
# What an operator can do about a damaged groups.json (the refusal to open says it). Only the
# settings are here: offsets and POP state are in offsets.json and the POP log.
DAMAGED_ADVICE = ("It holds the consumer groups' settings. Restore it from a backup or from a replica's "
                  "data directory (replicas keep a copy), or move it aside: every group then takes the "
                  f"default settings (not FIFO, max_attempts {DEFAULT_MAX_ATTEMPTS}) until set again "
                  "(chronoq group create, or [groups.*] of the config file, applied at start); offsets "
                  "and deliveries in flight are kept.")


@dataclass
class GroupConfig:
    name: str
    fifo: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # deliveries before dead-lettering
    # Back-off levels (names.backoff_level). PopService sets the broker's table; not saved in
    # groups.json, so a restart with another timer_delay_levels follows it.
    retry_delays_ms: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"fifo": self.fifo, "max_attempts": self.max_attempts}


class GroupBook:
    """The groups' settings, loaded from and saved to ``groups.json`` at every change."""

    def __init__(self, data_dir: str, retry_delays_ms: tuple[int, ...], max_groups: int = 10_000) -> None:
        self.data_dir = data_dir
        self.retry_delays_ms = retry_delays_ms
        # Clients create groups (a receive, a route or settings call of an unknown one): each
        # costs its POP state and offsets and a rewrite of groups.json, so they are bounded.
        self.max_groups = max_groups
        self._groups: dict[str, GroupConfig] = {}
        self._load()

    def __contains__(self, name: str) -> bool:
        return name in self._groups

    def _load(self) -> None:
        path = os.path.join(self.data_dir, GROUPS_FILE)
        data = fsutil.read_source(path, DAMAGED_ADVICE)
        try:
            for name, item in (data.get("groups") or {}).items():
                self._groups[name] = self._new(name, bool(item.get("fifo", False)),
                                               int(item.get("max_attempts", DEFAULT_MAX_ATTEMPTS)))
        except (AttributeError, TypeError, ValueError) as exc:
            raise errors.CorruptionError(path, 0, f"a group entry is not as written ({exc})", DAMAGED_ADVICE) from None

    def _new(self, name: str, fifo: bool = False, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> GroupConfig:
        return GroupConfig(name, fifo, max_attempts, self.retry_delays_ms)

    def _save(self) -> None:
        fsutil.write_json(os.path.join(self.data_dir, GROUPS_FILE), {
            "version": GROUPS_VERSION,
            "groups": {name: cfg.to_json() for name, cfg in sorted(self._groups.items())},
        })

    def get(self, name: str) -> GroupConfig:
        """The group's settings; an unknown (valid) group is created with the defaults."""
        cfg = self._groups.get(name)
        if cfg is None:
            validate.group_name(name)
            self._check_room(name, errors.GroupNotFound)
            cfg = self._groups[name] = self._new(name)
            self._save()
        return cfg

    def peek(self, name: str) -> GroupConfig | None:
        """The group's settings, None for an unknown group (none is created)."""
        return self._groups.get(name)

    def _check_room(self, name: str, error: type[errors.ChronoqError]) -> None:
        if len(self._groups) >= self.max_groups:
            raise error(f"consumer group {name!r} not created: the broker holds max_groups ({self.max_groups}) "
                        "groups; delete unused ones (chronoq group delete) or raise max_groups")

    def set(self, name: str, *, fifo: bool | None = None, max_attempts: int | None = None) -> GroupConfig:
        """Change a group's settings (durable). Unnamed settings keep their value."""
        validate.group_name(name)
        if fifo is not None and type(fifo) is not bool:
            raise errors.ClientError(f"fifo must be true or false, not {fifo!r}")
        if max_attempts is not None and (type(max_attempts) is not int
                                         or not 1 <= max_attempts <= names.MAX_ATTEMPTS_LIMIT):
            raise errors.ClientError(f"max_attempts must be an integer from 1 to {names.MAX_ATTEMPTS_LIMIT}, "
                                     f"not {max_attempts!r}")
        cfg = self._groups.get(name)
        if cfg is None:
            self._check_room(name, errors.ClientError)
            cfg = self._new(name)
        if fifo is not None:
            cfg.fifo = fifo
        if max_attempts is not None:
            cfg.max_attempts = max_attempts
        self._groups[name] = cfg
        self._save()
        return cfg

    def delete(self, name: str) -> None:
        """Forget a group's settings (durable); a group without settings is left as it is."""
        if self._groups.pop(name, None) is not None:
            self._save()

    def list(self) -> list[GroupConfig]:
        return [self._groups[name] for name in sorted(self._groups)]
