"""The disk tier's clean-close index: a clean close leaves one, the next open takes it away and
trusts it only for chunk files still listed under their names, and anything else (no index, a
damaged one, files added or gone while closed) ends as the full scan would."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.store.errors import CorruptChunk, DiskFullError
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.disk import DiskTier
from kvctl.store.tiers.disk_index import INDEX_NAME, Index, IndexedChunk, decode, encode
from tests.tmpfs import tmpfs
from tests.unit.test_disk_tier import as_after_a_crash, chunk_path, key, put

KIB = 1024
CAPACITY_BYTES = 1 << 20


def _fill(directory: Path, n: int = 6) -> dict[bytes, bytes]:
    """``n`` chunks with varied metadata, closed cleanly: key -> payload."""
    out = {}
    with DiskTier(directory, CAPACITY_BYTES) as tier:
        for i in range(n):
            fields = {
                "tokens": 16 + i,
                "tenant": f"tenant-{i % 3}" if i else "",
                "priority": i - 2,
                "isolated": i % 2 == 1,
                "created_s": 1000.0 + i,
                "parent": key(i - 1) if i else None,
            }
            out[key(i)] = put(tier, i, 2 * KIB + i, **fields)
    return out


def _opened(directory: Path) -> tuple[list[ChunkMeta], dict[bytes, bytes], int, list[str]]:
    """What an open finds: its recovered metas (oldest first), each chunk's bytes, its used
    bytes, and what it logged."""
    handler = _Records()
    logger = logging.getLogger("kvctl.store")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with DiskTier(directory, CAPACITY_BYTES) as tier:
            metas = tier.recover()
            data = {k: tier.get(k) for k in list(tier.keys())}
            used = tier.used_bytes
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return metas, data, used, handler.messages


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_clean_close_leaves_an_index_the_next_open_reads_and_takes_away(tmp_path: Path) -> None:
    kept = _fill(tmp_path)
    assert (tmp_path / INDEX_NAME).stat().st_mode & 0o777 == 0o600
    metas, data, used, said = _opened(tmp_path)
    assert data == kept
    assert used == sum(len(v) for v in kept.values())
    assert said[-1].endswith(", 6 of them from its clean-close index")
    # the same chunks, metadata and order as a scan of every file finds
    as_after_a_crash(tmp_path)  # (the second open's clean close left one again)
    scanned, scanned_data, scanned_used, scan_said = _opened(tmp_path)
    assert (metas, data, used) == (scanned, scanned_data, scanned_used)
    assert "clean-close index" not in scan_said[-1]


def test_the_open_takes_the_index_away_so_a_crash_after_it_means_a_full_scan(
    tmp_path: Path,
) -> None:
    _fill(tmp_path, 2)
    tier = DiskTier(tmp_path, CAPACITY_BYTES)
    try:
        assert not (tmp_path / INDEX_NAME).exists()  # gone before the first put
        put(tier, 50, 3 * KIB)
    finally:
        # a tier abandoned without close (garbage collected, as a crash leaves it) writes none
        tier._close(keep_index=False)
    assert not (tmp_path / INDEX_NAME).exists()
    _metas, data, _used, said = _opened(tmp_path)
    assert set(data) == {key(0), key(1), key(50)}
    assert "clean-close index" not in said[-1]


def test_files_gone_or_added_while_closed_are_as_the_directory_says(tmp_path: Path) -> None:
    kept = _fill(tmp_path, 4)
    chunk_path(tmp_path, key(1)).unlink()  # gone while the agent was down
    # a whole chunk file added while it was down (another tier's): read and checked
    other = tmp_path.parent / "other"
    with DiskTier(other, CAPACITY_BYTES) as tier:
        added = put(tier, 77, 5 * KIB, tenant="t9")
    chunk_path(tmp_path, key(77)).parent.mkdir(exist_ok=True)
    shutil.copyfile(chunk_path(other, key(77)), chunk_path(tmp_path, key(77)))
    metas, data, used, said = _opened(tmp_path)
    assert data == {
        key(0): kept[key(0)],
        key(2): kept[key(2)],
        key(3): kept[key(3)],
        key(77): added,
    }
    assert next(m for m in metas if m.key == key(77)).tenant == "t9"
    assert used == sum(len(v) for v in data.values())
    assert ": 4 files, 4 chunks (" in said[-1]
    assert said[-1].endswith(", 3 of them from its clean-close index")


@pytest.mark.parametrize("damage", ["flip", "cut", "empty", "version"])
def test_a_damaged_index_is_ignored_whole_and_the_scan_finds_everything(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    kept = _fill(tmp_path)
    path = tmp_path / INDEX_NAME
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "cut":
        raw = raw[: len(raw) - 7]
    elif damage == "empty":
        raw = bytearray()
    else:  # another version's, whole and checksummed: not this build's to read
        raw = bytearray(_encoded(decode(bytes(raw))))
        raw[4] = 99
        raw[-4:] = zlib.crc32(raw[:-4]).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvctl.store"):
        _metas, data, _used, said = _opened(tmp_path)
    assert data == kept
    assert "clean-close index" not in said[-1]
    if damage != "empty":
        assert any("ignored" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("field", ["checksum_kind", "size_bytes", "header_bytes"])
def test_an_intact_index_with_an_entry_the_scan_would_refuse_is_ignored_whole(
    tmp_path: Path, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    # whole and checksummed, but with an entry no header check of this build passes (another
    # build's checksum kind, an empty payload, a header length its tenant does not give): were
    # it believed, reads of that chunk would raise KeyError (a kind with no checksum function)
    # or drop a good file (checked at the wrong offset or length), at every clean restart again
    kept = _fill(tmp_path, 3)
    path = tmp_path / INDEX_NAME
    index = decode(path.read_bytes())
    entries = list(index.chunks.values())
    odd = entries[1]
    if field == "checksum_kind":
        entries[1] = odd._replace(checksum_kind=9)
    elif field == "size_bytes":
        entries[1] = odd._replace(meta=dataclasses.replace(odd.meta, size_bytes=0))
    else:
        entries[1] = odd._replace(header_bytes=odd.header_bytes + 1)
    path.write_bytes(_encoded(Index({c.meta.key: c for c in entries}, index.dir_mtimes_ns)))
    with caplog.at_level(logging.WARNING, logger="kvctl.store"):
        _metas, data, _used, said = _opened(tmp_path)
    assert data == kept
    assert "clean-close index" not in said[-1]
    assert any("ignored" in r.getMessage() for r in caplog.records), caplog.text


def test_a_chunk_file_damaged_in_place_after_a_clean_close_is_dropped_on_read_not_served(
    tmp_path: Path,
) -> None:
    # the index's one blind spot: a file rewritten under its own name (kvctl never does so)
    kept = _fill(tmp_path, 3)
    bad = chunk_path(tmp_path, key(2))
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # its payload's last byte
    bad.write_bytes(bytes(raw))
    with DiskTier(tmp_path, CAPACITY_BYTES) as tier:
        assert tier.get(key(0)) == kept[key(0)]
        with pytest.raises(CorruptChunk):
            tier.read_into(key(2), memoryview(bytearray(len(kept[key(2)]))))


def test_verify_on_open_reads_every_payload_whatever_the_index_says(tmp_path: Path) -> None:
    _fill(tmp_path, 3)
    bad = chunk_path(tmp_path, key(1))
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with DiskTier(tmp_path, CAPACITY_BYTES, verify_on_open=True) as tier:
        assert set(tier.keys()) == {key(0), key(2)} and tier.dropped_on_open == 1


def test_no_index_is_left_while_a_detached_write_is_under_way(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, CAPACITY_BYTES)
    put(tier, 0, 2 * KIB)
    slot = tier.reserve_write(ChunkMeta(key=key(1), size_bytes=2 * KIB))
    tier.write_reserved(slot, bytes(2 * KIB))
    tier.close()  # its temp file is a crash's leftover now: the next open scans
    assert not (tmp_path / INDEX_NAME).exists()
    with DiskTier(tmp_path, CAPACITY_BYTES) as again:
        assert set(again.keys()) == {key(0)} and again.dropped_on_open == 1


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["put", "delete", "reopen", "unlink", "plant"]), st.integers(0, 11)
        ),
        max_size=40,
    )
)
def test_an_open_through_the_index_finds_what_a_full_scan_finds(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int]]
) -> None:
    """Random puts, deletes and clean reopens, with files taken away or planted while closed:
    every open through the index finds the same chunks, metadata and bytes as a scan of every
    file of the same directory."""
    d = tmp_path_factory.mktemp("prop")
    spare = tmp_path_factory.mktemp("spare")
    with DiskTier(spare, CAPACITY_BYTES) as source:
        for i in range(12):
            put(source, i, 1 * KIB + i, tenant=f"s{i}")
    tier = DiskTier(d, CAPACITY_BYTES)
    try:
        for op, i in steps:
            if op == "put" and key(i) not in tier:
                put(tier, i, 1 * KIB + 3 * i, tokens=i, tenant=f"t{i % 2}")
            elif op == "delete" and key(i) in tier:
                tier.delete(key(i))
            elif op in ("reopen", "unlink", "plant"):
                tier.close()
                f = chunk_path(d, key(i))
                if op == "unlink" and f.exists():
                    f.unlink()
                elif op == "plant" and not f.exists():
                    f.parent.mkdir(exist_ok=True)
                    shutil.copyfile(chunk_path(spare, key(i)), f)
                if (d / INDEX_NAME).exists():
                    index_bytes = (d / INDEX_NAME).read_bytes()
                    via_index = _opened(d)[:3]
                    as_after_a_crash(d)
                    assert via_index == _opened(d)[:3]
                    (d / INDEX_NAME).write_bytes(index_bytes)  # the original one, for the next
                tier = DiskTier(d, CAPACITY_BYTES)
    finally:
        tier.close()


def test_the_index_round_trips_every_field() -> None:
    chunks = [
        IndexedChunk(
            ChunkMeta(
                key=key(i),
                size_bytes=1 + i,
                tokens=i,
                tenant=["", "a", "ünï"][i % 3],
                parent=key(i + 100) if i % 2 else None,
                priority=-5 + i,
                isolated=bool(i % 2),
                created_s=1.5 * i,
            ),
            94 + i,
            2,
            (1 << 63) + i,
        )
        for i in range(5)
    ]
    dirs = {"ab": 5, "0f": -1}
    assert decode(_encoded(Index({c.meta.key: c for c in chunks}, dirs))) == Index(
        {c.meta.key: c for c in chunks}, dirs
    )
    assert decode(_encoded(Index({}, {}))) == Index({}, {})


def _encoded(index: Index) -> bytes:
    return b"".join(encode(index.chunks.values(), index.dir_mtimes_ns))


def _replace_by_rename(directory: Path, k: bytes, data: bytes) -> None:
    """Put ``data`` at chunk ``k``'s file name the way any writer that does it safely does: a
    new file renamed over it (the fan-out directory's mtime moves)."""
    path = chunk_path(directory, k)
    tmp = path.with_name(".replacing")
    tmp.write_bytes(data)
    os.utime(path.parent, ns=(0, 0))  # the rename below gives it a new mtime whatever the clock
    tmp.rename(path)


def test_a_file_replaced_while_closed_is_read_as_the_scan_reads_it_not_believed(
    tmp_path: Path,
) -> None:
    # an older build (no index) that evicted a chunk and stored it again, a restore, an rsync:
    # what the directory holds now wins over what the close recorded
    _fill(tmp_path, 3)
    torn = chunk_path(tmp_path, key(1)).read_bytes()[:-100]
    _replace_by_rename(tmp_path, key(1), torn)
    other = tmp_path.parent / "other"
    with DiskTier(other, CAPACITY_BYTES) as tier:
        again = put(tier, 2, 2 * KIB + 2, tenant="someone-else")
    _replace_by_rename(tmp_path, key(2), chunk_path(other, key(2)).read_bytes())
    with DiskTier(tmp_path, CAPACITY_BYTES) as tier:
        assert key(1) not in tier and tier.dropped_on_open == 1  # torn: dropped at open
        assert tier.meta_of(key(2)).tenant == "someone-else" and tier.get(key(2)) == again
        assert key(0) in tier


def test_no_index_is_left_where_it_would_eat_into_the_headroom(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        tier = DiskTier(mnt / "disk", 1 << 30)  # the filesystem, not --disk, is the limit
        n = 0
        try:
            while True:  # until a put would take the free space below the headroom
                put(tier, n, 1024)
                n += 1
        except DiskFullError:
            pass
        with caplog.at_level(logging.INFO, logger="kvctl.store"):
            tier.close()
        assert not (mnt / "disk" / INDEX_NAME).exists()
        said = [r.getMessage() for r in caplog.records]
        assert any("no index left for the next open" in m for m in said), said
        with DiskTier(mnt / "disk", 1 << 30) as again:  # the scan finds them all
            assert len(again) == n


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_an_index_that_is_no_regular_file_is_removed_unread(tmp_path: Path, kind: str) -> None:
    # a FIFO would hold the open (and the agent's start) forever; a link would read another file
    kept = _fill(tmp_path, 3)
    real = tmp_path / INDEX_NAME
    elsewhere = tmp_path.parent / "elsewhere"
    real.rename(elsewhere)
    if kind == "fifo":
        os.mkfifo(real, 0o600)
    else:
        real.symlink_to(elsewhere)
    _metas, data, _used, said = _opened(tmp_path)
    assert data == kept and "clean-close index" not in said[-1]
    assert elsewhere.read_bytes()[:4] == b"KVCI"  # the link's target is left alone
