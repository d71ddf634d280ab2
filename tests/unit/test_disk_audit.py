"""audit_directory judges a disk tier directory as an open would, without changing anything:
what `kvctl bench crash` reads after a kill, before the restart repairs it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.disk import DiskTier, audit_directory


def _key(i: int) -> bytes:
    return hashlib.blake2b(f"audit-{i}".encode(), digest_size=16).digest()


def _path(root: Path, i: int) -> Path:
    h = _key(i).hex()
    return root / h[:2] / f"{h}.kv"


def test_audit_finds_whole_torn_corrupt_and_temp_files_and_changes_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    with DiskTier(root, 1 << 20) as tier:
        for i in range(4):
            tier.put(ChunkMeta(key=_key(i), size_bytes=1000), memoryview(bytes([i]) * 1000))
    torn, flipped = _path(root, 1), _path(root, 2)
    os.truncate(torn, torn.stat().st_size - 10)
    with open(flipped, "r+b") as f:  # one payload byte: only a verified audit sees it
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    temp = _path(root, 3).parent / f".{_key(3).hex()}.123.1.tmp"
    temp.write_bytes(b"half a chunk")
    before = sorted((p, p.stat().st_mode, p.stat().st_size) for p in root.rglob("*"))

    audit = audit_directory(root)
    assert audit.chunk_keys == {_key(0), _key(3)} and audit.chunk_bytes == 2000
    assert audit.temp_files == (f"{temp.parent.name}/{temp.name}",)
    reasons = dict(line.split(": ", 1) for line in audit.invalid_files)
    assert reasons[str(torn.relative_to(root))].startswith("torn")
    assert reasons[str(flipped.relative_to(root))] == "payload checksum mismatch"
    assert sorted((p, p.stat().st_mode, p.stat().st_size) for p in root.rglob("*")) == before

    quick = audit_directory(root, verify=False)  # header and length only
    assert quick.chunk_keys == {_key(0), _key(2), _key(3)}

    with DiskTier(root, 1 << 20, verify_on_open=True) as tier:  # the open agrees
        assert set(tier.keys()) == audit.chunk_keys
        assert tier.dropped_on_open == len(audit.temp_files) + len(audit.invalid_files)
