"""DiskTier against real files: format, recovery, corruption, capacity, full disk, kill -9."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from array import array
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    DiskFullError,
    InvalidArgument,
    KeyNotFound,
    PayloadSizeError,
    TierUnavailable,
)
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.disk import DiskTier
from kvctl.store.tiers.disk_index import INDEX_NAME
from tests.tmpfs import tmpfs

REPO_ROOT = Path(__file__).resolve().parents[2]
KIB = 1024
MIB = 1024 * KIB


def key(i: int) -> bytes:
    return hashlib.blake2b(f"chunk-{i}".encode(), digest_size=16).digest()


def payload(i: int, size_bytes: int) -> bytes:
    return random.Random(i).randbytes(size_bytes)


def meta(i: int, size_bytes: int, **fields: object) -> ChunkMeta:
    return ChunkMeta(key=key(i), size_bytes=size_bytes, **fields)  # type: ignore[arg-type]


def put(tier: DiskTier, i: int, size_bytes: int, **fields: object) -> bytes:
    data = payload(i, size_bytes)
    tier.put(meta(i, size_bytes, **fields), memoryview(data))
    return data


def chunk_path(directory: Path, k: bytes) -> Path:
    return directory / k.hex()[:2] / f"{k.hex()}.kv"


def as_after_a_crash(directory: Path) -> None:
    """Take away the index a clean close left in ``directory``, as an agent killed mid-use
    leaves none: the next open reads every chunk file's header (the scan these tests check).
    After a clean close it would trust the index for each file still listed under its name."""
    (directory / INDEX_NAME).unlink()


def files_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.tmp"))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


# --- round trips and format --------------------------------------------------------------------
@pytest.mark.parametrize("size_bytes", [1, 97, 4096, 256 * KIB + 3, 4 * MIB])
def test_round_trip(tmp_path: Path, size_bytes: int) -> None:
    with DiskTier(tmp_path, 64 * MIB) as tier:
        data = put(tier, 1, size_bytes)
        assert key(1) in tier
        assert len(tier) == 1
        assert tier.size_of(key(1)) == size_bytes
        assert tier.used_bytes == size_bytes
        assert tier.free_bytes == 64 * MIB - size_bytes
        assert list(tier.keys()) == [key(1)]
        assert tier.get(key(1)) == data
        # a larger buffer: only the chunk's bytes are written, the tail is left alone
        out = bytearray(b"\xee" * (size_bytes + 5))
        assert tier.read_into(key(1), memoryview(out)) == size_bytes
        assert out[:size_bytes] == data
        assert out[size_bytes:] == b"\xee" * 5


def test_file_layout_fans_out_by_first_key_byte(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        for i in range(5):
            put(tier, i, 1000 + i)
        for i in range(5):
            path = chunk_path(tmp_path, key(i))
            assert path.is_file()
            # header is extra on top of the payload bytes the tier accounts
            assert path.stat().st_size > 1000 + i
        assert tier.used_bytes == sum(1000 + i for i in range(5))
        assert temp_files(tmp_path) == []
        assert (tmp_path / ".lock").exists()


def test_non_byte_buffers_are_stored_as_raw_bytes(tmp_path: Path) -> None:
    values = array("I", range(1000))
    raw = values.tobytes()
    with DiskTier(tmp_path, MIB) as tier:
        tier.put(ChunkMeta(key(1), len(raw)), memoryview(values))
        out = array("I", bytes(len(raw)))
        assert tier.read_into(key(1), memoryview(out)) == len(raw)
        assert out == values


def test_reopen_restores_every_meta_field_and_payload(tmp_path: Path) -> None:
    metas = [
        ChunkMeta(key(0), 300, tokens=256, tenant="", parent=None, created_s=10.0),
        ChunkMeta(
            key(1),
            5000,
            tokens=256,
            tenant="tenant-ünï-東京",
            parent=key(0),
            priority=-7,
            isolated=True,
            created_s=11.5,
        ),
        ChunkMeta(key(2), 1, tokens=3, tenant="b", parent=key(1), priority=90, created_s=9.25),
    ]
    with DiskTier(tmp_path, MIB) as tier:
        for i, m in enumerate(metas):
            tier.put(m, payload(i, m.size_bytes))
    with DiskTier(tmp_path, MIB) as tier:
        assert tier.dropped_on_open == 0
        assert tier.dropped_reasons == []
        # oldest first, every field as written
        assert tier.recover() == sorted(metas, key=lambda m: m.created_s)
        assert tier.used_bytes == sum(m.size_bytes for m in metas)
        for i, m in enumerate(metas):
            assert tier.meta_of(m.key) == m
            assert tier.get(m.key) == payload(i, m.size_bytes)
        # recover() forgets what was deleted since the open
        tier.delete(key(2))
        assert [m.key for m in tier.recover()] == [key(0), key(1)]


def test_fsync_mode_round_trips_and_survives_reopen(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB, fsync=True) as tier:
        data = put(tier, 1, 70 * KIB)
        shutil.rmtree(tmp_path / key(1).hex()[:2])  # gone behind the tier's back...
        with pytest.raises(CorruptChunk):
            tier.read_into(key(1), memoryview(bytearray(70 * KIB)))
        data = put(tier, 1, 70 * KIB)  # ...and the subdirectory comes back on the next put
    with DiskTier(tmp_path, MIB, fsync=True) as tier:
        assert tier.get(key(1)) == data


# --- recovery ----------------------------------------------------------------------------------
def test_open_drops_torn_garbage_temp_and_misnamed_files(tmp_path: Path) -> None:
    healthy = {}
    with DiskTier(tmp_path, 16 * MIB) as tier:
        for i in range(6):
            healthy[i] = put(tier, i, 20 * KIB + i, tokens=i)
    as_after_a_crash(tmp_path)
    planted = 0
    # torn: a chunk cut short (a crash mid-write that somehow became visible)
    torn = chunk_path(tmp_path, key(0))
    os.truncate(torn, torn.stat().st_size - 100)
    del healthy[0]
    planted += 1
    # a header byte flipped (inside the tenant/meta area): the header checksum fails
    bad_header = chunk_path(tmp_path, key(1))
    with open(bad_header, "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0x01]))
    del healthy[1]
    planted += 1
    # a valid chunk file under another key's name
    misnamed = chunk_path(tmp_path, key(100))
    misnamed.parent.mkdir(exist_ok=True)
    shutil.copyfile(chunk_path(tmp_path, key(2)), misnamed)
    planted += 1
    # garbage with a chunk's name, and garbage with a name that is not a chunk's
    garbage = chunk_path(tmp_path, key(101))
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(os.urandom(5000))
    planted += 1
    (chunk_path(tmp_path, key(3)).parent / "notes.txt").write_bytes(b"hello")
    planted += 1
    # a header-only stub (shorter than any header)
    stub = chunk_path(tmp_path, key(102))
    stub.parent.mkdir(exist_ok=True)
    stub.write_bytes(b"KVCD")
    planted += 1
    # leftover temp files from a writer that died, in a fan-out dir and at the top
    (chunk_path(tmp_path, key(4)).parent / f".{key(4).hex()}.999.1.tmp").write_bytes(b"x" * 99)
    (tmp_path / ".probe.999.tmp").write_bytes(b"k")
    planted += 2
    # an operator's file at the top level is not the tier's to delete
    (tmp_path / "README").write_text("kv cache")

    with DiskTier(tmp_path, 16 * MIB) as tier:
        assert tier.dropped_on_open == planted
        assert len(tier.dropped_reasons) == planted
        reasons = "\n".join(tier.dropped_reasons)
        for why in ("torn", "header checksum", "not the one in its name", "temp file"):
            assert why in reasons
        assert set(tier.keys()) == {key(i) for i in healthy}
        assert tier.used_bytes == sum(len(d) for d in healthy.values())
        for i, data in healthy.items():
            assert tier.get(key(i)) == data
            assert tier.meta_of(key(i)).tokens == i
        expected_files = {".lock", "README"} | {
            str(chunk_path(tmp_path, key(i)).relative_to(tmp_path)) for i in healthy
        }
        assert files_under(tmp_path) == expected_files
    with DiskTier(tmp_path, 16 * MIB) as tier:
        assert tier.dropped_on_open == 0


def test_recovered_bytes_over_capacity_are_kept(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1000) as tier:
        for i in range(3):
            put(tier, i, 300)
    with DiskTier(tmp_path, 500) as tier:
        assert len(tier) == 3
        assert tier.used_bytes == 900
        assert tier.free_bytes == -400
        with pytest.raises(CapacityError):
            put(tier, 9, 1)
        with pytest.raises(CapacityError):
            tier.resize(899)
        tier.delete(key(0))
        tier.delete(key(1))
        put(tier, 9, 200)
        assert tier.used_bytes == 500


# --- corruption on read ------------------------------------------------------------------------
def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def test_flipped_payload_byte_is_detected_on_read(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        put(tier, 1, 10 * KIB)
        other = put(tier, 2, 10 * KIB)
        flip_last_byte(chunk_path(tmp_path, key(1)))
        with pytest.raises(CorruptChunk, match=key(1).hex()):
            tier.get(key(1))
        assert key(1) not in tier
        assert tier.used_bytes == 10 * KIB
        assert not chunk_path(tmp_path, key(1)).exists()
        with pytest.raises(KeyNotFound):
            tier.get(key(1))
        assert tier.get(key(2)) == other


def test_short_file_is_detected_on_read(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        put(tier, 1, 10 * KIB)
        path = chunk_path(tmp_path, key(1))
        os.truncate(path, path.stat().st_size - 1)
        with pytest.raises(CorruptChunk, match="short"):
            tier.get(key(1))
        assert key(1) not in tier
        assert tier.used_bytes == 0
        assert not path.exists()


def test_flipped_payload_byte_is_dropped_by_verify_on_open(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 64 * MIB) as tier:
        put(tier, 1, 10 * KIB)
        big = put(tier, 2, 9 * MIB)  # larger than the verify buffer: checked in pieces
    flip_last_byte(chunk_path(tmp_path, key(1)))
    with DiskTier(tmp_path, 64 * MIB, verify_on_open=True) as tier:
        assert tier.dropped_on_open == 1
        assert "payload checksum" in tier.dropped_reasons[0]
        assert list(tier.keys()) == [key(2)]
        assert tier.get(key(2)) == big
    assert not chunk_path(tmp_path, key(1)).exists()


# --- checksum kinds ----------------------------------------------------------------------------
# The on-disk header, spelled out here rather than taken from disk.py, so these tests pin the
# format that files already on disk were written in.
HEADER_FIXED = struct.Struct("<4sHHIB3x16sQQQqd16sH")
KIND_OFFSET = 12  # magic 4 + version 2 + flags 2 + header_len 4
CHECKSUM_OFFSET = 12 + 1 + 3 + 16 + 8  # ... + kind 1 + reserved 3 + key 16 + payload_size 8


def write_chunk_file(
    directory: Path, m: ChunkMeta, data: bytes, checksum_kind: int, checksum: int
) -> Path:
    """A chunk file as any build writing format version 1 would have, with the given checksum."""
    tenant = m.tenant.encode()
    flags = (0x1 if m.isolated else 0) | (0x2 if m.parent is not None else 0)
    header_len = HEADER_FIXED.size + len(tenant) + 4
    body = HEADER_FIXED.pack(
        b"KVCD",
        1,
        flags,
        header_len,
        checksum_kind,
        m.key,
        m.size_bytes,
        checksum,
        m.tokens,
        m.priority,
        m.created_s,
        m.parent or bytes(16),
        len(tenant),
    )
    body += tenant
    path = chunk_path(directory, m.key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)) + data)
    return path


def stored_checksum(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    return raw[KIND_OFFSET], int.from_bytes(raw[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 8], "little")


def flip_byte(path: Path, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


def test_new_writes_use_xxh3_64(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        data = put(tier, 1, 10 * KIB)
    assert stored_checksum(chunk_path(tmp_path, key(1))) == (2, xxhash.xxh3_64_intdigest(data))


def test_flipped_payload_byte_is_detected_with_xxh3(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 64 * MIB) as tier:
        put(tier, 1, 10 * KIB)
        put(tier, 2, 9 * MIB)  # streamed through the verify buffer in pieces
        kept = put(tier, 3, 10 * KIB)
        put(tier, 4, 10 * KIB)
    for i in (1, 2, 4):
        assert stored_checksum(chunk_path(tmp_path, key(i)))[0] == 2
    flip_byte(chunk_path(tmp_path, key(1)), 5 * KIB)  # mid-payload
    flip_byte(chunk_path(tmp_path, key(2)), 1)  # in the last verify piece
    with DiskTier(tmp_path, 64 * MIB, verify_on_open=True) as tier:
        assert tier.dropped_on_open == 2
        assert all("payload checksum" in why for why in tier.dropped_reasons)
        assert set(tier.keys()) == {key(3), key(4)}
        assert tier.get(key(3)) == kept
        flip_byte(chunk_path(tmp_path, key(4)), 1)
        with pytest.raises(CorruptChunk, match="checksum"):
            tier.get(key(4))
        assert set(tier.keys()) == {key(3)}


def test_crc32_chunks_from_older_builds_stay_readable(tmp_path: Path) -> None:
    old = {
        1: ChunkMeta(key(1), 10 * KIB, tokens=16, tenant="old-ü", parent=key(0), created_s=1.0),
        2: ChunkMeta(key(2), 9 * MIB, tokens=99, priority=-3, isolated=True, created_s=2.0),
        3: ChunkMeta(key(3), 3000, created_s=3.0),
    }
    data = {i: payload(i, m.size_bytes) for i, m in old.items()}
    for i, m in old.items():
        write_chunk_file(tmp_path, m, data[i], 1, zlib.crc32(data[i]))
    for verify in (False, True):
        with DiskTier(tmp_path, 64 * MIB, verify_on_open=verify) as tier:
            assert tier.dropped_reasons == []
            assert tier.recover() == list(old.values())
            for i, m in old.items():
                assert tier.meta_of(m.key) == m
                assert tier.get(m.key) == data[i]
            if verify:  # new puts next to the old chunks are xxh3; both kinds read back
                new = put(tier, 4, 5000)
    assert stored_checksum(chunk_path(tmp_path, key(4)))[0] == 2
    assert stored_checksum(chunk_path(tmp_path, key(1)))[0] == 1  # never rewritten
    with DiskTier(tmp_path, 64 * MIB, verify_on_open=True) as tier:
        assert tier.dropped_on_open == 0
        assert tier.get(key(4)) == new
        assert tier.get(key(1)) == data[1]
        # a flipped byte in an old chunk is still caught by its CRC-32
        flip_byte(chunk_path(tmp_path, key(3)), 100)
        with pytest.raises(CorruptChunk, match="checksum"):
            tier.get(key(3))
    flip_byte(chunk_path(tmp_path, key(2)), 1)
    with DiskTier(tmp_path, 64 * MIB, verify_on_open=True) as tier:
        assert tier.dropped_on_open == 1
        assert "payload checksum" in tier.dropped_reasons[0]
        assert set(tier.keys()) == {key(1), key(4)}


def test_unknown_checksum_kind_is_dropped_at_open(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        put(tier, 2, 100)
    # a valid header (its own CRC matches) naming a payload checksum this build does not know
    path = write_chunk_file(tmp_path, ChunkMeta(key(1), 1000), payload(1, 1000), 7, 0)
    with DiskTier(tmp_path, MIB) as tier:
        assert tier.dropped_on_open == 1
        assert "unknown checksum kind 7" in tier.dropped_reasons[0]
        assert list(tier.keys()) == [key(2)]
    assert not path.exists()


# --- capacity and argument checks --------------------------------------------------------------
def test_capacity_is_enforced_to_the_byte(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1000) as tier:
        put(tier, 1, 600)
        before = files_under(tmp_path)
        with pytest.raises(CapacityError):
            put(tier, 2, 401)
        assert files_under(tmp_path) == before
        assert (len(tier), tier.used_bytes) == (1, 600)
        put(tier, 2, 400)  # exactly fits
        assert tier.free_bytes == 0
        with pytest.raises(CapacityError):
            put(tier, 3, 1)
        assert tier.delete(key(1)) == 600
        assert not chunk_path(tmp_path, key(1)).exists()
        assert tier.used_bytes == 400


def test_duplicate_and_size_mismatch_change_nothing(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        data = put(tier, 1, 100)
        before = files_under(tmp_path)
        with pytest.raises(InvalidArgument, match="already"):
            tier.put(meta(1, 100), b"\0" * 100)
        with pytest.raises(PayloadSizeError):
            tier.put(meta(2, 100), b"\0" * 99)
        with pytest.raises(InvalidArgument):
            tier.put(meta(3, 0), b"")
        with pytest.raises(InvalidArgument, match="16 bytes"):
            tier.put(ChunkMeta(b"short", 4), b"abcd")
        with pytest.raises(InvalidArgument, match="tenant"):
            tier.put(meta(4, 4, tenant="x" * 70_000), b"abcd")
        with pytest.raises(InvalidArgument):
            tier.put(meta(5, 4, tokens=-1), b"abcd")
        with pytest.raises(InvalidArgument):
            tier.read_into(key(1), memoryview(bytearray(99)))
        with pytest.raises(InvalidArgument):
            tier.read_into(key(1), memoryview(bytes(100)))
        assert files_under(tmp_path) == before
        assert (len(tier), tier.used_bytes) == (1, 100)
        assert tier.get(key(1)) == data


def test_unknown_key(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        assert key(1) not in tier
        with pytest.raises(KeyNotFound):
            tier.size_of(key(1))
        with pytest.raises(KeyNotFound):
            tier.read_into(key(1), memoryview(bytearray(10)))
        with pytest.raises(KeyNotFound):
            tier.get(key(1))
        with pytest.raises(KeyNotFound):
            tier.delete(key(1))


def test_resize(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1000) as tier:
        put(tier, 1, 600)
        with pytest.raises(CapacityError):
            tier.resize(599)
        with pytest.raises(InvalidArgument):
            tier.resize(-1)
        assert tier.capacity_bytes == 1000
        tier.resize(600)
        assert tier.free_bytes == 0
        tier.resize(5000)
        put(tier, 2, 4400)
    with pytest.raises(InvalidArgument):
        DiskTier(tmp_path, -5)


# --- directory, lock, close --------------------------------------------------------------------
def test_directory_that_is_a_file_or_under_a_file_is_unavailable(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("not a directory")
    for bad in (plain, plain / "sub"):
        with pytest.raises(TierUnavailable, match=str(plain)):
            DiskTier(bad, MIB)


def test_other_write_errors_raise_tier_unavailable_and_leave_no_temp(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MIB) as tier:
        put(tier, 1, 100)
        sub = chunk_path(tmp_path, key(2)).parent
        shutil.rmtree(sub, ignore_errors=True)
        sub.write_bytes(b"")  # a file where the fan-out directory should be: ENOTDIR
        with pytest.raises(TierUnavailable, match=str(sub)):
            put(tier, 2, 100)
        assert (len(tier), tier.used_bytes) == (1, 100)
        assert temp_files(tmp_path) == []


def test_second_open_of_a_directory_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MIB)
    with pytest.raises(TierUnavailable, match="in use"):
        DiskTier(tmp_path, MIB)
    # another process is refused too
    code = (
        "import sys\nfrom kvctl.store.tiers.disk import DiskTier\n"
        "from kvctl.store.errors import TierUnavailable\n"
        "try:\n    DiskTier(sys.argv[1], 10)\nexcept TierUnavailable as e:\n"
        "    print('refused', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.startswith("refused"), out.stderr
    tier.close()
    DiskTier(tmp_path, MIB).close()


def test_use_after_close_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MIB)
    put(tier, 1, 10)
    tier.close()
    tier.close()  # idempotent
    calls = [
        lambda: tier.put(meta(2, 10), b"0123456789"),
        lambda: tier.read_into(key(1), memoryview(bytearray(10))),
        lambda: tier.get(key(1)),
        lambda: tier.delete(key(1)),
        lambda: tier.resize(10),
        lambda: tier.size_of(key(1)),
        lambda: key(1) in tier,
        lambda: len(tier),
        lambda: tier.keys(),
        lambda: tier.used_bytes,
        lambda: tier.recover(),
    ]
    for call in calls:
        with pytest.raises(TierUnavailable, match="closed"):
            call()


# --- full disk ---------------------------------------------------------------------------------
_EFBIG_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    from kvctl.store.errors import DiskFullError
    from kvctl.store.tiers.base import ChunkMeta
    from kvctl.store.tiers.disk import DiskTier

    directory = sys.argv[1]
    k = [bytes([i]) * 16 for i in range(3)]
    tier = DiskTier(directory, 1 << 30)
    tier.put(ChunkMeta(k[0], 64 * 1024), b"a" * 64 * 1024)
    # Files may grow to 256 KiB; writing past it fails with EFBIG instead of killing us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
    result = {}
    try:
        tier.put(ChunkMeta(k[1], 1024 * 1024), b"b" * 1024 * 1024)
    except DiskFullError as exc:
        result["error"] = str(exc)
        result["errno"] = exc.errno
    result["tmp"] = [n for _, _, fs in os.walk(directory) for n in fs if n.endswith(".tmp")]
    result["len"] = len(tier)
    result["used"] = tier.used_bytes
    tier.put(ChunkMeta(k[2], 1000), b"c" * 1000)  # small writes still work afterwards
    tier.close()
    print(json.dumps(result))
    """
)


def test_disk_full_efbig_leaves_tier_unchanged(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _EFBIG_CHILD, str(tmp_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["errno"] == 27  # EFBIG
    assert "out of space" in result["error"]
    assert str(tmp_path) in result["error"]
    assert f"{1024 * 1024} payload" in result["error"]
    assert result["tmp"] == []
    assert (result["len"], result["used"]) == (1, 64 * 1024)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert tier.dropped_on_open == 0
        assert set(tier.keys()) == {bytes([0]) * 16, bytes([2]) * 16}
        assert tier.get(bytes([0]) * 16) == b"a" * 64 * 1024
        assert tier.get(bytes([2]) * 16) == b"c" * 1000


def test_disk_full_enospc_on_tiny_tmpfs(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        with DiskTier(mnt, 10 * MIB) as tier:
            first = put(tier, 1, 600 * KIB)
            with pytest.raises(DiskFullError, match=str(mnt)) as info:
                put(tier, 2, 600 * KIB)
            assert info.value.errno == 28  # ENOSPC
            assert temp_files(mnt) == []
            assert (len(tier), tier.used_bytes) == (1, 600 * KIB)
            # the failed write's space came back: after making room the same put succeeds
            tier.delete(key(1))
            second = put(tier, 2, 600 * KIB)
            assert tier.get(key(2)) == second
            del first
        # a filesystem that is full at open still opens: its chunks can be read and evicted
        with open(mnt / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            filler.write(b"\0" * MIB)
        with DiskTier(mnt, 10 * MIB) as tier:
            assert tier.get(key(2)) == second
            with pytest.raises(DiskFullError):
                put(tier, 3, 100 * KIB)
            assert temp_files(mnt) == []


# --- crash safety ------------------------------------------------------------------------------
_WRITER_CHILD = textwrap.dedent(
    """
    import hashlib, os, sys
    from kvctl.store.tiers.base import ChunkMeta
    from kvctl.store.tiers.disk import DiskTier

    def say(op, i):
        # one write(2) per line, so a kill never cuts one (print makes several when the
        # environment has PYTHONUNBUFFERED set)
        os.write(1, f"{op} {i}\\n".encode())

    directory, start = sys.argv[1], int(sys.argv[2])
    sizes = [1000, 64 * 1024, 700 * 1024, 2 * 1024 * 1024 + 5]
    tier = DiskTier(directory, 1 << 40)
    written = []
    i = start
    while True:
        k = hashlib.blake2b(f"chunk-{i}".encode(), digest_size=16).digest()
        size = sizes[i % len(sizes)]
        # cheap to build, so the child spends its time writing and most kills land mid-put
        data = (hashlib.blake2b(str(i).encode()).digest() * (size // 64 + 1))[:size]
        tier.put(ChunkMeta(k, size, tokens=i), data)
        say("put", i)
        written.append(i)
        if i % 4 == 3:  # delete an older chunk now and then, so deletes get killed too
            j = written.pop(0)
            say("deleting", j)
            tier.delete(hashlib.blake2b(f"chunk-{j}".encode(), digest_size=16).digest())
            say("deleted", j)
        i += 1
    """
)


def crash_payload(i: int, size_bytes: int) -> bytes:
    return (hashlib.blake2b(str(i).encode()).digest() * (size_bytes // 64 + 1))[:size_bytes]


def test_kill_9_never_leaves_a_torn_or_wrong_chunk(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    sizes = [1000, 64 * KIB, 700 * KIB, 2 * MIB + 5]  # as in the child
    committed: set[int] = set()
    deleting: set[int] = set()  # a delete may have been in flight at the kill
    deleted: set[int] = set()
    next_index = 0
    rng = random.Random(7)
    for round_no in range(8):
        err_path = tmp_path / f"child-{round_no}.err"
        with open(err_path, "wb") as err_file:
            child = subprocess.Popen(
                [sys.executable, "-c", _WRITER_CHILD, str(directory), str(next_index)],
                env=child_env(),
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
            )
        assert child.stdout is not None
        target_puts = rng.randint(5, 25)
        lines: list[str] = []
        deadline = time.monotonic() + 20
        for line in child.stdout:
            lines.append(line)
            if sum(x.startswith("put") for x in lines) >= target_puts:
                break
            if time.monotonic() > deadline:
                break
        time.sleep(rng.random() * 0.003)  # spread the kill over the put cycle
        child.send_signal(signal.SIGKILL)
        # read() and not communicate(): communicate reads the raw pipe and would lose what the
        # text wrapper has already buffered
        lines.extend(child.stdout.read().splitlines(keepends=True))
        child.stdout.close()
        assert child.wait(timeout=20) == -signal.SIGKILL, err_path.read_text()
        for line in lines:
            # each line is one pipe write, so lines are whole; the check guards the parsing
            assert line.endswith("\n"), lines
            op, idx = line.split()
            {"put": committed, "deleting": deleting, "deleted": deleted}[op].add(int(idx))
        assert committed, err_path.read_text()
        # the put in flight (max + 1) may or may not have landed; never reuse its key
        next_index = max(committed) + 2

        expected = {key(i): i for i in range(next_index)}
        with DiskTier(directory, 1 << 40) as tier:
            # a kill may leave a temp file, never a visible chunk that is torn
            assert all("temp file" in why for why in tier.dropped_reasons), tier.dropped_reasons
            assert temp_files(directory) == []
            present = set(tier.keys())
            assert present <= set(expected)
            for k in present:
                i = expected[k]
                m = tier.meta_of(k)
                assert (m.tokens, m.size_bytes) == (i, sizes[i % len(sizes)])
                assert tier.get(k) == crash_payload(i, m.size_bytes)
            assert {key(i) for i in committed - deleting} <= present
            assert not present & {key(i) for i in deleted}


# --- property: random operations against a dict model ------------------------------------------
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(1, 3000)),
        st.tuples(st.just("delete"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("reopen"), st.just(0), st.just(0)),
        st.tuples(st.just("resize"), st.just(0), st.integers(0, 12_000)),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_random_operations_match_a_dict_model(ops: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        capacity_bytes = 8000
        model: dict[bytes, bytes] = {}
        tier = DiskTier(directory, capacity_bytes)
        try:
            for step, (op, i, n) in enumerate(ops):
                used_bytes = sum(len(v) for v in model.values())
                if op == "put":
                    data = payload(step * 100 + i, n)
                    m = ChunkMeta(key(i), n, tokens=step, tenant=f"t{i}")
                    if key(i) in model:
                        with pytest.raises(InvalidArgument):
                            tier.put(m, data)
                    elif used_bytes + n > capacity_bytes:
                        with pytest.raises(CapacityError):
                            tier.put(m, data)
                    else:
                        tier.put(m, data)
                        model[key(i)] = data
                elif op == "delete":
                    if key(i) in model:
                        assert tier.delete(key(i)) == len(model.pop(key(i)))
                    else:
                        with pytest.raises(KeyNotFound):
                            tier.delete(key(i))
                elif op == "resize":
                    if n < used_bytes:
                        with pytest.raises(CapacityError):
                            tier.resize(n)
                    else:
                        tier.resize(n)
                        capacity_bytes = n
                else:
                    tier.close()
                    tier = DiskTier(directory, capacity_bytes)
                    assert tier.dropped_on_open == 0
                assert set(tier.keys()) == set(model)
                assert tier.used_bytes == sum(len(v) for v in model.values())
            tier.close()
            tier = DiskTier(directory, capacity_bytes, verify_on_open=True)
            assert tier.dropped_on_open == 0
            assert {m.key for m in tier.recover()} == set(model)
            for k, data in model.items():
                assert tier.get(k) == data
        finally:
            tier.close()


# --- detached reads (planned under the store's lock, read without it) ---------------------------


def test_a_planned_read_changes_nothing_and_reports_failures(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    data = put(tier, 1, 5000)
    plan = tier.plan_read(key(1))
    assert plan.size_bytes == 5000 and tier.plan_is_current(plan)
    out = bytearray(5000)
    assert tier.read_planned(plan, memoryview(out)) is None and out == data

    raw = bytearray(chunk_path(tmp_path, key(1)).read_bytes())
    raw[-1] ^= 1
    chunk_path(tmp_path, key(1)).write_bytes(raw)
    assert tier.read_planned(plan, memoryview(out)) == "its payload failed the checksum"
    assert key(1) in tier and tier.used_bytes == 5000  # the failure is the caller's to judge
    exc = tier.drop_unreadable(key(1), "its payload failed the checksum")
    assert isinstance(exc, CorruptChunk) and "checksum" in str(exc)
    assert key(1) not in tier and tier.used_bytes == 0
    assert not chunk_path(tmp_path, key(1)).exists()
    assert not tier.plan_is_current(plan)
    assert tier.read_planned(plan, memoryview(out)) == "its file is missing"
    with pytest.raises(InvalidArgument):
        tier.read_planned(plan, memoryview(bytearray(10)))


def test_a_plan_is_stale_once_its_chunk_is_rewritten(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    data = put(tier, 1, 3000)
    plan = tier.plan_read(key(1))
    tier.delete(key(1))
    tier.put(meta(1, 3000, tenant="someone-else"), data)  # same bytes, a longer header
    assert not tier.plan_is_current(plan)
    out = bytearray(3000)
    # the stale plan's header length no longer fits the file: caught, never wrong bytes
    assert tier.read_planned(plan, memoryview(out)) is not None
    fresh = tier.plan_read(key(1))
    assert tier.read_planned(fresh, memoryview(out)) is None and out == data


def test_delete_later_forgets_at_once_and_leaves_the_unlink_to_its_call(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    data = put(tier, 1, 5000)
    put(tier, 2, 100)
    cleanup = tier.delete_later(key(1))
    assert cleanup is not None
    assert key(1) not in tier and tier.used_bytes == 100
    assert not chunk_path(tmp_path, key(1)).exists()  # out of the way at once
    (trash,) = [p for p in files_under(tmp_path) if p.endswith(".tmp")]
    put(tier, 1, 5000)  # the same key again while the old file waits for its unlink
    cleanup()
    assert not any(p.endswith(".tmp") for p in files_under(tmp_path)), trash
    assert tier.get(key(1)) == data  # the new copy was not touched

    leftover = tier.delete_later(key(2))  # a crash before the call: removed at the next open
    assert leftover is not None
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert not any(p.endswith(".tmp") for p in files_under(tmp_path))
    assert list(again.keys()) == [key(1)]
    chunk_path(tmp_path, key(1)).unlink()
    assert again.delete_later(key(1)) is None and key(1) not in again  # file already gone


def test_a_put_near_capacity_unlinks_the_files_still_waiting_for_their_unlink(
    tmp_path: Path,
) -> None:
    # a renamed-away file keeps its blocks until its unlink: near a full disk a put writing
    # before that could hit ENOSPC, so the put unlinks it first
    tier = DiskTier(tmp_path, 10_000)
    put(tier, 1, 5000)
    put(tier, 2, 5000)
    cleanup = tier.delete_later(key(1))
    assert cleanup is not None
    assert tier.used_bytes == 5000 and tier.pending_unlink_bytes == 5000
    assert len(temp_files(tmp_path)) == 1
    put(tier, 3, 5000)
    assert temp_files(tmp_path) == [] and tier.pending_unlink_bytes == 0
    cleanup()  # nothing left to do
    assert tier.get(key(3)) == payload(3, 5000) and tier.get(key(2)) == payload(2, 5000)

    # with room to spare a put leaves the unlink to its call (off the store's lock)
    tier.resize(20_000)
    later = tier.delete_later(key(2))
    assert later is not None
    put(tier, 4, 5000)
    assert len(temp_files(tmp_path)) == 1 and tier.pending_unlink_bytes == 5000
    later()
    assert temp_files(tmp_path) == [] and tier.pending_unlink_bytes == 0


def test_growing_past_the_filesystems_free_space_is_refused(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1000) as tier:
        put(tier, 1, 600)
        room = tier.room_bytes()
        assert room is not None and room >= 600
        with pytest.raises(CapacityError, match="free; free space or ask for less"):
            tier.resize(room + (1 << 30))
        assert tier.capacity_bytes == 1000
        tier.resize(min(room, 1 << 20))  # what the filesystem holds is taken
        assert tier.capacity_bytes == min(room, 1 << 20)
        tier.resize(700)  # a shrink is never refused for the filesystem's sake


def test_an_agent_whose_disk_tier_outgrows_its_filesystem_says_so_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import os

    from kvctl.agent.runtime import AgentRuntime
    from kvctl.agent.settings import AgentSettings

    fs = os.statvfs(tmp_path)
    too_big = fs.f_bavail * fs.f_frsize + (1 << 40)
    settings = AgentSettings(
        name="d1", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=too_big, shm=False
    )
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        runtime = AgentRuntime.open(settings)
        runtime.close()
    assert any(
        "evicts its own chunks when the filesystem fills" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    fits = dataclasses.replace(settings, disk_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        AgentRuntime.open(fits).close()
    assert not any(
        "evicts its own chunks when the filesystem fills" in r.getMessage() for r in caplog.records
    )
