"""Host memory registered with CUDA (kvctl.store.tiers.hostreg).

Everywhere: addresses of buffers, tensors that alias mapped memory, the registry's books (by
owner, by address, across generations, owners collected) over a stand-in for the two CUDA calls
(tests/unit/hostreg_fakes.py), and the error without CUDA. With CUDA: real registrations, copies
through them, and what a refused registration leaves behind."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import re
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvctl.errors import InvalidArgument
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.gpu import gpu_available
from kvctl.store.tiers.hostreg import (
    HOST_REGISTER_PORTABLE,
    HOST_REGISTER_READ_ONLY,
    CudaRegistrar,
    HostRegistration,
    HostRegistrationError,
    HostRegistry,
    buffer_address,
    register_host,
    registration_available,
)
from tests.unit.cuda_marks import needs_cuda, needs_torch, torch, without_cuda
from tests.unit.hostreg_fakes import PAGE, FakeRegistrar, mapped, shared_maps

# --- everywhere: addresses and aliasing --------------------------------------------------------


def test_buffer_address_of_writable_read_only_and_sliced_buffers() -> None:
    with shared_maps(4 * PAGE) as (rw, ro):
        base = ctypes.addressof(ctypes.c_char.from_buffer(rw))
        assert buffer_address(rw) == base
        assert buffer_address(memoryview(rw)[100:200]) == base + 100
        # ctypes refuses read-only buffers; numpy agrees with what we find
        assert buffer_address(ro) == np.frombuffer(ro, dtype=np.uint8).ctypes.data
        assert buffer_address(memoryview(ro)[PAGE:]) == buffer_address(ro) + PAGE
        arr = bytearray(b"abc")
        assert buffer_address(arr) == ctypes.addressof(ctypes.c_char.from_buffer(arr))
        gc.collect()  # the ctypes objects above hold exports of rw
    with pytest.raises(TypeError):
        buffer_address(12)  # type: ignore[arg-type]


@needs_torch
def test_tensor_view_aliases_the_mapping_both_ways() -> None:
    fake = FakeRegistrar()
    with shared_maps(2 * PAGE) as (rw, ro):
        reg = HostRegistration(rw, read_only=False, registrar=fake)
        t = reg.tensor_view(10, 20)
        assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel() == 20
        assert t.data_ptr() == buffer_address(rw) + 10  # no copy
        rw[10:13] = b"\x01\x02\x03"  # written through the mapping: seen in the tensor
        assert t[:3].tolist() == [1, 2, 3]
        t[5] = 99  # written through the tensor: seen in the mapping (and the other mapping)
        assert rw[15] == 99 and ro[15] == 99
        # a read-only mapping: the tensor sees what another mapping writes
        ro_reg = HostRegistration(ro, read_only=True, registrar=fake)
        r = ro_reg.tensor_view(PAGE, 4)
        rw[PAGE : PAGE + 4] = b"kvkv"
        assert bytes(r.numpy()) == b"kvkv"
        with pytest.raises(InvalidArgument, match="outside the registered"):
            reg.tensor_view(2 * PAGE - 1, 2)
        with pytest.raises(InvalidArgument, match="outside the registered"):
            reg.tensor_view(-1, 2)
        del t, r
        reg.close()
        ro_reg.close()


# --- everywhere: one registration over the stand-in ----------------------------------------------


def test_a_registration_registers_once_holds_the_mapping_and_unregisters_once() -> None:
    fake = FakeRegistrar()
    with shared_maps(3 * PAGE) as (rw, ro):
        with register_host(rw, read_only=False, registrar=fake) as reg:
            assert fake.calls == [
                ("register", buffer_address(rw), 3 * PAGE, HOST_REGISTER_PORTABLE)
            ]
            assert (reg.address, reg.size_bytes, reg.read_only, reg.closed) == (
                buffer_address(rw), 3 * PAGE, False, False
            )  # fmt: skip
            assert reg.contains(reg.address + PAGE, PAGE)
            assert not reg.contains(reg.address + PAGE, 2 * PAGE + 1)
            assert not reg.contains(reg.address - 1, 2)
            # the mapping cannot go away under a registration
            with pytest.raises(BufferError):
                rw.close()
        assert reg.closed and fake.live == {} and fake.count("unregister") == 1
        reg.close()  # idempotent
        assert fake.count("unregister") == 1
        with register_host(ro, read_only=True, registrar=fake) as ro_reg:
            assert fake.calls[-1][3] == HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY
            assert ro_reg.read_only
        with pytest.raises(HostRegistrationError, match="closed"):
            ro_reg.tensor_view(0, 1)


@pytest.mark.parametrize("refuse", [False, True])
def test_close_unregisters_before_it_lets_go_of_the_mapping(refuse: bool) -> None:
    """The registration's export may be the mapping's last reference: dropping it first would
    unmap the range while CUDA still has it registered (locked pages of no mapping)."""
    fake = FakeRegistrar()
    reg = register_host(mmap.mmap(-1, 2 * PAGE), read_only=False, registrar=fake)  # only ref
    address = reg.address
    assert mapped(address, 2 * PAGE)
    if refuse:
        fake.refuse = "cudaHostUnregister failed: unknown error (cudaError 999)"
        with pytest.raises(HostRegistrationError, match="unknown error"):
            reg.close()
    else:
        reg.close()
    assert fake.calls[-1] == ("unregister", address) and reg.closed
    assert fake.unmapped_at_unregister == []  # still mapped when it was unregistered
    # and let go of after, even when unregistering failed: the mapping went with its export
    assert not mapped(address, 2 * PAGE)


def test_a_registry_unregisters_a_region_before_it_lets_go_of_the_mapping() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    reg = registry.register("staging", mmap.mmap(-1, PAGE), read_only=True)
    address = reg.address
    del reg
    assert registry.unregister("staging") and fake.live == {}
    assert fake.unmapped_at_unregister == [] and not mapped(address, PAGE)
    registry.register("arena", mmap.mmap(-1, PAGE), read_only=False)
    registry.close()
    assert fake.live == {} and fake.unmapped_at_unregister == []


def test_bad_buffers_are_refused_before_cuda_is_asked() -> None:
    fake = FakeRegistrar()
    with shared_maps(PAGE) as (_rw, ro):
        with pytest.raises(InvalidArgument, match="read_only=True"):
            register_host(ro, read_only=False, registrar=fake)
        with pytest.raises(InvalidArgument, match="empty"):
            register_host(bytearray(), read_only=False, registrar=fake)
        strided = memoryview(bytearray(64))[::2]
        with pytest.raises(InvalidArgument, match="contiguous"):
            register_host(strided, read_only=True, registrar=fake)
    assert fake.calls == []


def test_a_refused_registration_leaves_the_mapping_free() -> None:
    fake = FakeRegistrar()
    fake.refuse = "cudaHostRegister failed: out of memory (cudaError 2)"
    with shared_maps(PAGE) as (rw, _ro), pytest.raises(HostRegistrationError, match="memory"):
        register_host(rw, read_only=False, registrar=fake)
    # shared_maps closed rw: no export was left behind


def test_a_device_without_read_only_registration_is_named_as_the_cause() -> None:
    fake = FakeRegistrar()
    fake.refuse = "cudaHostRegister failed: operation not supported (cudaError 801)"
    refused = pytest.raises(HostRegistrationError, match="HostRegisterReadOnlySupported")
    with shared_maps(PAGE) as (_rw, ro), refused:
        register_host(ro, read_only=True, registrar=fake)
    with shared_maps(PAGE) as (rw, _ro):  # a writable registration: no such hint
        with pytest.raises(HostRegistrationError) as err:
            register_host(rw, read_only=False, registrar=fake)
        assert "ReadOnly" not in str(err.value)


@without_cuda
def test_without_cuda_registering_says_why() -> None:
    _ok, why = gpu_available()
    assert registration_available() == (False, why)
    with pytest.raises(HostRegistrationError, match="cannot be registered with CUDA") as err:
        register_host(bytearray(PAGE), read_only=False)
    assert why in str(err.value)
    registry = HostRegistry()  # asks nothing of CUDA until the first registration
    assert len(registry) == 0 and registry.find(bytearray(8)) is None
    with pytest.raises(HostRegistrationError, match=re.escape(why)):
        registry.register("arena", bytearray(PAGE), read_only=False)
    assert len(registry) == 0


@needs_torch
def test_cuda_errors_become_one_clear_error_and_are_drained() -> None:
    """CudaRegistrar's error handling, over stand-ins for torch's cudart bindings."""
    drained: list[str] = []

    class Error(int):
        pass

    cudart = SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: Error(712),
        cudaHostUnregister=lambda ptr: Error(0),
        cudaGetErrorString=lambda err: (
            "part or all of the requested memory range is already mapped"
        ),
    )
    reg = CudaRegistrar.__new__(CudaRegistrar)
    reg._torch = SimpleNamespace(cuda=SimpleNamespace(device=lambda _i: contextlib.nullcontext()))
    reg._index, reg._cudart = 0, cudart
    reg._clear_last_error = lambda: drained.append("drained")  # type: ignore[method-assign]
    with pytest.raises(HostRegistrationError) as err:
        reg.register(0x1000, 4096, HOST_REGISTER_PORTABLE)
    assert str(err.value) == (
        "cudaHostRegister of 4096 bytes at 0x1000 failed: part or all of the requested memory "
        "range is already mapped (cudaError 712)"
    )
    assert drained == ["drained"]
    reg.unregister(0x1000)  # success: nothing raised, nothing drained
    assert drained == ["drained"]


# --- everywhere: the registry over the stand-in -------------------------------------------------


def test_registry_finds_slices_inside_a_region_and_nothing_outside() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    with shared_maps(4 * PAGE) as (rw, ro), shared_maps(PAGE) as (other, _):
        arena = registry.register("arena", rw, read_only=False)
        staging = registry.register("staging", ro, read_only=True)
        view = memoryview(rw)
        assert registry.find(view[100:300]) == (arena, 100)
        assert registry.find(view[4 * PAGE - 8 :]) == (arena, 4 * PAGE - 8)
        assert registry.find(view) == (arena, 0)
        assert registry.find(memoryview(ro)[PAGE:]) == (staging, PAGE)
        assert registry.find(memoryview(ro)[PAGE:], writable=True) is None  # read-only region
        assert registry.find(memoryview(rw)[PAGE:], writable=True) == (arena, PAGE)
        assert registry.find(bytearray(64)) is None  # a socket's receive buffer
        assert registry.find(memoryview(other)[:10]) is None
        assert registry.find(view[:0]) is None
        t = registry.tensor_for(view[8:16])
        assert t is not None and t.data_ptr() == buffer_address(rw) + 8 and t.numel() == 8
        assert registry.tensor_for(bytearray(8)) is None
        del t, view
        assert {r["owner"] for r in registry.regions()} == {"arena", "staging"}
        registry.close()
        assert fake.live == {} and len(registry) == 0
        with pytest.raises(HostRegistrationError, match="closed"):
            registry.register("again", rw, read_only=False)


def test_registering_an_owner_again_keeps_replaces_or_fails_cleanly() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    with shared_maps(PAGE) as (a, _), shared_maps(2 * PAGE) as (b, _b):
        first = registry.register("staging", a, read_only=False)
        assert registry.register("staging", a, read_only=False) is first  # same bytes: kept
        assert fake.count("register") == 1
        second = registry.register("staging", a, read_only=False, generation=1)
        assert second is not first and first.closed and fake.count("unregister") == 1
        third = registry.register("staging", b, read_only=False, generation=1)
        assert second.closed and third.address == buffer_address(b)
        assert list(fake.live) == [buffer_address(b)]
        fake.refuse = "cudaHostRegister failed: invalid argument (cudaError 1)"
        with pytest.raises(HostRegistrationError, match="invalid argument"):
            registry.register("staging", a, read_only=False)
        assert third.closed and len(registry) == 0  # the old one went first
        fake.refuse = None
        assert registry.unregister("staging") is False
        registry.close()


def test_an_owner_object_is_not_kept_alive_and_its_region_goes_with_it() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)

    class Connection:
        pass

    with shared_maps(PAGE) as (a, _), shared_maps(PAGE) as (b, _b):
        conn, other = Connection(), Connection()
        registry.register(conn, a, read_only=False)
        registry.register(other, b, read_only=False)
        assert len(registry) == 2
        del conn
        gc.collect()
        assert len(registry) == 1 and list(fake.live) == [buffer_address(b)]
        assert registry.unregister(other) is True and fake.live == {}
        registry.close()


def test_a_followed_region_follows_the_cpu_arena_across_resizes() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    cpu = CpuTier(4 * PAGE, shared=True)
    try:
        arena, generation = cpu.arena_mapping()
        assert generation == 0
        reg = registry.follow("cpu-arena", cpu.arena_mapping, read_only=False)
        assert reg.address == buffer_address(arena) and reg.size_bytes == 4 * PAGE
        del arena
        registry.refresh()  # same generation: nothing asked of CUDA
        assert fake.count("register") == 1
        cpu.resize(8 * PAGE)  # a new arena, a new generation
        registry.refresh()
        arena, generation = cpu.arena_mapping()
        (region,) = registry.regions()
        assert region["generation"] == generation == 1 and region["followed"]
        assert region["size_bytes"] == 8 * PAGE
        assert list(fake.live) == [buffer_address(arena)] and reg.closed
        assert fake.unmapped_at_unregister == []
        assert registry.find(memoryview(arena)[:PAGE], writable=True) is not None
        del arena
    finally:
        cpu.close()
    registry.refresh()  # the source raises now (closed tier): the region is dropped
    assert len(registry) == 0 and fake.live == {}
    with pytest.raises(TierUnavailable):
        registry.follow("cpu-arena", cpu.arena_mapping, read_only=False)


def test_a_followed_region_that_cannot_be_registered_again_is_dropped() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    cpu = CpuTier(PAGE)
    try:
        registry.follow("cpu-arena", cpu.arena_mapping, read_only=False)
        cpu.resize(2 * PAGE)
        fake.refuse = "cudaHostRegister failed: out of memory (cudaError 2)"
        registry.refresh()  # not raised: copies of its bytes will be staged
        assert len(registry) == 0
    finally:
        cpu.close()


def test_borrow_holds_off_unregistering_until_the_copy_is_done() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    with shared_maps(PAGE) as (rw, _):
        registry.register("staging", rw, read_only=False)
        done = threading.Event()

        def unregister() -> None:
            registry.unregister("staging")
            done.set()

        thread = threading.Thread(target=unregister)
        with registry.borrow(memoryview(rw)[:10]) as t:
            assert t is not None
            thread.start()
            assert not done.wait(0.2)  # blocked while the copy holds the region
            del t
        thread.join(5)
        assert done.is_set() and fake.live == {}


# --- CUDA only ---------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("size", [1, PAGE + 3, (3 << 20) + 17])
def test_registered_mapping_to_the_device_and_back_is_bit_exact(size: int) -> None:
    payload = os.urandom(size)
    with shared_maps(size) as (src, _), shared_maps(size) as (dst, _d):
        src[:] = payload
        stream = torch.cuda.Stream()
        with register_host(src, read_only=False) as rs, register_host(dst, read_only=False) as rd:
            on_device = torch.empty(size, dtype=torch.uint8, device="cuda")
            with torch.cuda.stream(stream):
                on_device.copy_(rs.tensor_view(0, size), non_blocking=True)
                rd.tensor_view(0, size).copy_(on_device, non_blocking=True)
            stream.synchronize()
            assert dst[:] == payload
        del on_device


@needs_cuda
def test_a_read_only_mapping_registers_and_copies_to_the_device() -> None:
    size = (2 << 20) + 5
    payload = os.urandom(size)
    with shared_maps(size) as (rw, ro):
        rw[:] = payload
        with register_host(ro, read_only=True) as reg:
            on_device = torch.empty(size, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                on_device.copy_(reg.tensor_view(0, size), non_blocking=True)
            stream.synchronize()
            assert on_device.cpu().numpy().tobytes() == payload


@needs_cuda
def test_close_unregisters_and_a_refused_registration_leaves_cuda_usable() -> None:
    with shared_maps(4 * PAGE) as (rw, _):
        reg = register_host(rw, read_only=False)
        # the same range again: CUDA refuses (already registered), with its error in the message
        with pytest.raises(HostRegistrationError, match=r"cudaHostRegister .* failed: .*cudaError"):
            register_host(rw, read_only=False)
        # the refusal left no error behind for torch's next kernel launch to trip over
        assert torch.ones(8, device="cuda").sum().item() == 8
        reg.close()
        reg.close()
        # registering again works only because close unregistered it
        again = register_host(rw, read_only=False)
        again.close()
        del reg, again


@needs_cuda
def test_a_registry_registers_with_cuda_and_unregisters_on_close() -> None:
    with shared_maps(4 * PAGE) as (rw, _):
        registry = HostRegistry()
        registry.register("arena", rw, read_only=False)
        t = registry.tensor_for(memoryview(rw)[PAGE : 2 * PAGE], writable=True)
        assert t is not None and t.numel() == PAGE
        del t
        registry.close()
        register_host(rw, read_only=False).close()  # free to register: the registry let go


def _following(registry: HostRegistry, cpu: CpuTier) -> None:
    """What the agent wires up for a gpu tier over a cpu tier (``_register_cpu_arena``)."""
    registry.follow("cpu-arena", cpu.arena_mapping, read_only=False)
    cpu.on_arena_replaced(registry.refresh)
    cpu.on_arena_prepared(
        lambda arena, gen, given_up: (
            registry.discard("cpu-arena", arena, gen)
            if given_up
            else registry.prepare("cpu-arena", arena, gen)
        )
    )


def test_a_resized_arena_is_registered_while_it_is_copied_not_when_it_takes_over() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    store = TieredStore([CpuTier(4 * PAGE, shared=True)])
    cpu = store.tier("cpu")
    assert isinstance(cpu, CpuTier)
    locked_at_register: list[bool] = []
    register = fake.register

    def noting(address: int, size_bytes: int, flags: int) -> None:
        locked_at_register.append(store._lock._is_owned())  # type: ignore[attr-defined]
        register(address, size_bytes, flags)

    fake.register = noting  # type: ignore[method-assign]
    try:
        _following(registry, cpu)
        store.put(b"a" * 16, bytes(PAGE))
        store.resize("cpu", 8 * PAGE)
        arena, generation = cpu.arena_mapping()
        assert generation == 1 and fake.count("register") == 2
        assert locked_at_register == [False, False]  # the new arena's: without the store's lock
        assert list(fake.live) == [buffer_address(arena)]
        (region,) = registry.regions()
        assert (region["generation"], region["size_bytes"]) == (1, 8 * PAGE)
        assert store.get(b"a" * 16) == bytes(PAGE)
        del arena
    finally:
        store.close()
        registry.close()
    assert fake.unmapped_at_unregister == [] and fake.live == {}


def test_a_resize_given_up_lets_go_of_the_arena_it_registered_before_unmapping_it() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    cpu = CpuTier(4 * PAGE, shared=True)
    try:
        _following(registry, cpu)
        old = buffer_address(cpu.arena_mapping()[0])
        plan = cpu.begin_resize(8 * PAGE)
        assert plan is not None
        cpu.copy_resize(plan)
        assert fake.count("register") == 2 and len(fake.live) == 2
        cpu.abort_resize(plan)
        cpu.release_resize(plan)
        assert list(fake.live) == [old] and fake.unmapped_at_unregister == []
        registry.refresh()  # same generation: the region stays as it was
        assert fake.count("register") == 2 and registry.regions()[0]["generation"] == 0
    finally:
        registry.close()
        cpu.close()
    assert fake.unmapped_at_unregister == []


def test_prepare_needs_a_followed_region_and_the_right_buffer_to_be_taken() -> None:
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    with contextlib.ExitStack() as stack:
        fixed = stack.enter_context(mmap.mmap(-1, 2 * PAGE))
        other = stack.enter_context(mmap.mmap(-1, 2 * PAGE))
        registry.register("fixed", fixed, read_only=False)
        assert not registry.prepare("fixed", other, 1)  # follows nothing
        assert not registry.prepare("nobody", other, 1)
        cpu = CpuTier(4 * PAGE, shared=True)
        stack.callback(cpu.close)
        registry.follow("cpu-arena", cpu.arena_mapping, read_only=False)
        assert registry.prepare("cpu-arena", other, 1)  # not the arena the resize maps
        cpu.resize(8 * PAGE)  # under the lock, as before: generation 1, another mapping
        registry.refresh()
        arena, _ = cpu.arena_mapping()
        assert buffer_address(other) not in fake.live  # the wrong one was let go
        assert buffer_address(arena) in fake.live
        del arena
        registry.close()
    assert fake.unmapped_at_unregister == [] and fake.live == {}


def test_a_resize_given_up_late_keeps_the_registration_of_the_next_one() -> None:
    """Two resizes aiming at the same generation: the first, given up, lets go of its own arena's
    registration only, not of the one the second prepared meanwhile."""
    fake = FakeRegistrar()
    registry = HostRegistry(registrar=fake)
    cpu = CpuTier(4 * PAGE, shared=True)
    try:
        _following(registry, cpu)
        first = cpu.begin_resize(8 * PAGE)
        assert first is not None
        cpu.copy_resize(first)
        cpu.abort_resize(first)  # given up, not yet released
        second = cpu.begin_resize(16 * PAGE)
        assert second is not None
        cpu.copy_resize(second)
        assert fake.count("register") == 3
        cpu.release_resize(first)
        assert fake.count("unregister") == 1 and len(fake.live) == 2  # the first's only
        assert cpu.finish_resize(second)
        cpu.release_resize(second)
        assert fake.count("register") == 3  # the second's was taken, not made again
        arena, _ = cpu.arena_mapping()
        assert list(fake.live) == [buffer_address(arena)]
        del arena
    finally:
        registry.close()
        cpu.close()
    assert fake.unmapped_at_unregister == []
