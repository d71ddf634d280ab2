"""Exceptions raised by the store. Every one leaves the store as it was before the call."""

from __future__ import annotations

from kvctl import errors as _kvctl


class StoreError(_kvctl.KvctlError):
    """Base class for errors raised by kvctl.store."""


class InvalidArgument(StoreError, _kvctl.InvalidArgument):
    """A caller passed a value the store cannot accept (bad size, bad key, bad tokens)."""


class PayloadSizeError(InvalidArgument):
    """A chunk payload does not have the size the store or the key's entry requires."""


class KeyNotFound(StoreError, KeyError):
    """The key is not cached in the store (or not in the tier that was asked for)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "key not found"


class CapacityError(StoreError):
    """The tier cannot make room: the chunk is larger than the tier or the rest is pinned."""

    #: tiers a put passed over because their filesystem was full below their capacity (others'
    #: files, a --disk above the free space): part of why no tier took the chunk
    filesystem_full_tiers: tuple[str, ...] = ()


class TierUnavailable(StoreError):
    """A tier cannot be used: its directory is missing or not writable, or it was closed."""


class DirectoryInUse(TierUnavailable):
    """A disk tier's directory is locked by another DiskTier (another agent on the same data
    directory): unlike a broken directory, not something to start without."""


class DiskFullError(StoreError, OSError):
    """The disk tier's filesystem ran out of space (or quota) while writing a chunk."""

    #: bytes the chunk's file needed (header and payload)
    need_bytes: int = 0
    #: the filesystem's free bytes (for an unprivileged writer) just after the failed write;
    #: None where it could not be asked
    free_bytes: int | None = None
    #: free bytes the tier keeps on its filesystem, included in ``need_bytes``; 0 where the
    #: write met a real ENOSPC
    headroom_bytes: int = 0


class CorruptChunk(KeyNotFound):
    """A stored chunk could not be read back intact (checksum or header mismatch, file gone, I/O
    error); it has been dropped.

    A subclass of KeyNotFound because, to a reader, a corrupt chunk is a miss: it is never served.
    """
