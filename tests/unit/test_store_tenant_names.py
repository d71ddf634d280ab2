"""Tenant names are capped at MAX_TENANT_BYTES (UTF-8). Before, a name of up to 64 KiB (the
wire's string limit) was kept in each chunk's entry (``tenant``, ``tenants``), its events and
its disk file's header: a reviewer's client sent one-byte chunks each under its own 60 KB
tenant name and the agent grew ~60 KiB of memory per byte of tier capacity used. Now a longer
name is refused where it enters the store (InvalidArgument: 400 on the control API,
BAD_REQUEST on the data plane) and ``MetaReader.tenant`` refuses it when a frame is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import MAX_TENANT_BYTES, check_tenant
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.protocol import ErrorCode, FrameError, MetaReader, MetaWriter

KEY = bytes(range(16))
AT_CAP = "t" * MAX_TENANT_BYTES
#: one byte over, in characters of two bytes each (the cap counts bytes, not characters)
OVER_CAP = "é" * (MAX_TENANT_BYTES // 2) + "t"


def test_the_cap_counts_utf8_bytes() -> None:
    assert MAX_TENANT_BYTES == 256
    check_tenant("")
    check_tenant(AT_CAP)
    check_tenant("é" * (MAX_TENANT_BYTES // 2))  # 256 bytes in 128 characters
    with pytest.raises(InvalidArgument, match=r"tenant name is 257 bytes in UTF-8; at most 256"):
        check_tenant(OVER_CAP)


@pytest.fixture
def store(tmp_path: Path) -> TieredStore:
    return TieredStore([CpuTier(1 << 16), DiskTier(tmp_path / "disk", 1 << 20)])


def test_a_put_under_a_name_over_the_cap_is_refused_and_stores_nothing(
    store: TieredStore,
) -> None:
    with pytest.raises(InvalidArgument, match="tenant name"):
        store.put(KEY, b"x", tenant=OVER_CAP)
    with pytest.raises(InvalidArgument, match="tenant name"):
        store.put(KEY, b"x", tenant="T" * 60_000)  # the reviewer's name
    with pytest.raises(InvalidArgument, match="tenant name"):
        store.reserve_put(KEY, 1, tenant=OVER_CAP)
    assert len(store) == 0
    assert store.put(KEY, b"x", tenant=AT_CAP) == "cpu"
    assert store.entry(KEY).tenant == AT_CAP


def test_reads_and_lookups_under_a_name_over_the_cap_are_refused(store: TieredStore) -> None:
    """A read keeps its tenant too (``Entry.tenants``, up to 8 a chunk)."""
    store.put(KEY, b"x", tenant="a")
    for call in (
        lambda t: store.get(KEY, tenant=t),
        lambda t: store.get_uncounted(KEY, tenant=t),
        lambda t: store.read_into(KEY, bytearray(1), tenant=t),
        lambda t: store.touch(KEY, tenant=t),
        lambda t: store.lease(KEY, 10.0, tenant=t),
        lambda t: store.lease_many([KEY], 10.0, tenant=t),
        lambda t: store.lookup([KEY], tenant=t),
        lambda t: store.locate([KEY], tenant=t),
        lambda t: store.peek([KEY], tenant=t),
        lambda t: store.count_lookup([KEY], limit=1, tenant=t),
    ):
        with pytest.raises(InvalidArgument, match="tenant name"):
            call(OVER_CAP)
        call(AT_CAP)
    assert store.entry(KEY).tenants == {"a", AT_CAP}
    assert store.stats.lookups == 2  # lookup and count_lookup at the cap; none over it


def test_an_isolated_tenant_over_the_cap_is_refused(store: TieredStore) -> None:
    with pytest.raises(InvalidArgument, match="tenant name"):
        store.set_isolated_tenants(["alice", OVER_CAP])
    assert store.isolated_tenants == frozenset()
    store.set_isolated_tenants(["alice", AT_CAP])
    assert store.isolated_tenants == {"alice", AT_CAP}


def test_a_frames_tenant_over_the_cap_is_a_bad_request() -> None:
    meta = MetaReader(MetaWriter().text(OVER_CAP).u32(7).build())
    with pytest.raises(FrameError) as err:
        meta.tenant()
    assert err.value.code == ErrorCode.BAD_REQUEST and not err.value.fatal
    assert "tenant name is 257 bytes" in err.value.message
    meta = MetaReader(MetaWriter().text(AT_CAP).u32(7).build())
    assert meta.tenant() == AT_CAP
    assert meta.u32() == 7
    with pytest.raises(FrameError, match="truncated"):
        MetaReader(b"\x01").tenant()
