"""The arena descriptor a local client gets from the agent cannot be turned into a writer
(issue 22, item 3): reopened read-write through /proc/self/fd, it can neither write, nor map
the arena writable, nor resize it; the chunks read back unchanged and the agent lives on."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

import pytest

from kvctl.client import DataClient
from kvctl.wire.protocol import MetaReader, Op
from tests.functional.agents import key, payload, running_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd seals are Linux")

CHUNK = 64 << 10
READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE


def arena_fd(c: DataClient) -> tuple[int, int]:
    """The arena descriptor and size, asked for as the client does (MAP, the fd passed over
    the Unix socket), but kept instead of mapped and closed."""
    with c._lock:
        meta, _ = c._call_locked(Op.MAP, b"", (), None)
        r = MetaReader(meta)
        _generation, size = r.u64(), r.u64()
        assert len(c._fds) == 1
        return c._fds.pop(), size


def _mprotect_write_refused(fd: int, size: int) -> bool:
    """Map read-only and shared, then ask mprotect for write access (a known way around
    write seals on old kernels): True when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        return libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0
    finally:
        libc.munmap(addr, size)


def test_a_client_cannot_write_or_resize_the_arena_it_was_given(tmp_path: Path) -> None:
    with running_agent(tmp_path / "a", "--cpu", "4MiB") as agent, agent.data("unix") as c:
        assert c.shm
        keys = [key(i, 22) for i in range(4)]
        out = c.put_many([(k, payload(k, CHUNK)) for k in keys], tenant="t")
        assert [o.status for o in out] == ["stored"] * 4
        fd, size = arena_fd(c)
        try:
            # read-only as given
            with pytest.raises(OSError) as given:
                os.write(fd, b"x")
            assert given.value.errno == errno.EBADF
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(OSError) as wrote:
                    os.pwrite(rw, b"\xff" * 4096, 0)
                assert wrote.value.errno == errno.EPERM
                with pytest.raises(OSError) as mapped:
                    mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=READ_WRITE)
                assert mapped.value.errno == errno.EPERM
                assert _mprotect_write_refused(rw, size)
                for new_size in (0, size // 2, size * 2):
                    with pytest.raises(OSError) as truncated:
                        os.ftruncate(rw, new_size)
                    assert truncated.value.errno == errno.EPERM
                # punching a hole would zero the agent's chunks
                with pytest.raises(OSError):
                    _punch_hole(rw, size)
                assert os.fstat(rw).st_size == size
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        # the chunks are intact, through the arena and over the socket, and the agent lives
        got = c.get_many(keys, tenant="t")
        assert [bytes(g) if g is not None else None for g in got] == [
            payload(k, CHUNK) for k in keys
        ]
        with agent.data("unix", use_shm=False) as plain:
            assert [bytes(g) for g in plain.get_many(keys, tenant="t")] == [  # type: ignore[arg-type]
                payload(k, CHUNK) for k in keys
            ]
        assert agent.proc.poll() is None


def test_the_arena_a_resize_makes_is_sealed_too(tmp_path: Path) -> None:
    with running_agent(tmp_path / "a", "--cpu", "4MiB") as agent, agent.data("unix") as c:
        k = key(1, 23)
        c.put(k, payload(k, CHUNK), tenant="t")
        agent.control().resize("cpu", 6 << 20)  # a new arena (a sealed memfd cannot grow)
        fd, size = arena_fd(c)
        try:
            assert size == 6 << 20
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(OSError):
                    os.pwrite(rw, b"\xff" * 16, 0)
                with pytest.raises(OSError):
                    mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=READ_WRITE)
                with pytest.raises(OSError):
                    os.ftruncate(rw, 0)
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        assert bytes(c.get(k, tenant="t")) == payload(k, CHUNK)


def _punch_hole(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    falloc_fl_keep_size, falloc_fl_punch_hole = 0x01, 0x02
    if libc.fallocate(fd, falloc_fl_keep_size | falloc_fl_punch_hole, 0, size) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
