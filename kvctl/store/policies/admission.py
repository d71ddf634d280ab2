"""Admission policies: which chunks may enter a tier (``all``, ``frequency``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry


class AdmissionPolicy:
    """Admits everything. Subclasses gate which chunks may enter a tier."""

    name: ClassVar[str] = "all"

    def admit(self, entry: Entry) -> bool:
        return True

    def on_drop(self, entry: Entry) -> None:
        """A chunk left the store entirely (so a later return can be recognised)."""


class FrequencyAdmission(AdmissionPolicy):
    """Admit a chunk once it has been accessed ``min_accesses`` times, counting the accesses it
    had before an earlier drop (a bounded ghost list remembers them)."""

    name = "frequency"

    def __init__(self, min_accesses: int = 2, ghost_entries: int = 1 << 16) -> None:
        if min_accesses < 1:
            raise InvalidArgument("min_accesses must be at least 1")
        self.min_accesses = min_accesses
        self.ghost_entries = ghost_entries
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.refused = 0

    def admit(self, entry: Entry) -> bool:
        seen = entry.access_count + self._ghosts.get(entry.key, 0)
        if seen >= self.min_accesses:
            return True
        self.refused += 1
        return False

    def on_drop(self, entry: Entry) -> None:
        self._ghosts[entry.key] = self._ghosts.pop(entry.key, 0) + entry.access_count
        if len(self._ghosts) > self.ghost_entries:
            self._ghosts.popitem(last=False)
