"""KVLoader puts chunk bytes into the KV cache layout exactly as ``ChunkFormat.unpack`` would,
whatever the chunks' places in the source (adjacent runs, gaps, any order, misaligned)."""

from __future__ import annotations

import mmap
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from kvctl.client import ArenaLeases, LeasedChunk  # noqa: E402
from kvctl.engines.kvformat import ChunkFormat  # noqa: E402
from kvctl.engines.kvload import KVLoader, host_tensor, queue_leased_many, runs  # noqa: E402
from kvctl.store.keys import KVLayout  # noqa: E402
from kvctl.store.tiers.prefault import Prefaulter  # noqa: E402

FMT = ChunkFormat(KVLayout(3, 2, 8, "float32"), 4)
SIZE = FMT.chunk_bytes


def _chunks(n: int, seed: int = 0, fmt: ChunkFormat = FMT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(fmt.chunk_shape, generator=g).to(fmt.dtype).reshape(-1).view(torch.uint8)
        for _ in range(n)
    ]


def _reference(chunks: list[torch.Tensor], fmt: ChunkFormat = FMT) -> list[torch.Tensor]:
    per_layer = fmt.unpack(torch.cat(chunks), len(chunks))
    return [torch.stack((k, v)) for k, v in per_layer]  # [2, 1, heads, n*T, dim] per layer


def test_runs_join_adjacent_chunks_and_cap_their_size() -> None:
    assert runs([0, 10, 20, 50, 60, 5], 10, 1 << 20) == [(0, 3), (3, 2), (5, 1)]
    assert runs([0, 10, 20, 30], 10, 20) == [(0, 2), (2, 2)]
    assert runs([0, 10], 10, 1) == [(0, 1), (1, 1)]  # at least one chunk per run
    assert runs([], 10, 100) == []


@pytest.mark.parametrize("order", ["adjacent", "shuffled", "gaps"])
def test_load_lays_chunks_out_as_unpack_does(order: str) -> None:
    n = 7
    chunks = _chunks(n, seed=1)
    slots = {
        "adjacent": list(range(n)),
        "shuffled": [5, 6, 0, 1, 2, 9, 3],  # some runs of adjacent chunks, some jumps back
        "gaps": [0, 2, 4, 5, 6, 8, 10],
    }[order]
    arena = torch.zeros((max(slots) + 1) * SIZE, dtype=torch.uint8)
    for chunk, slot in zip(chunks, slots, strict=True):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(n)
    loader.load(arena, [s * SIZE for s in slots], kv)
    loader.wait()
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer], want)


def test_load_at_an_offset_fills_only_those_chunk_positions() -> None:
    chunks = _chunks(4, seed=2)
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(4)
    kv.fill_(float("nan"))
    loader.load(torch.cat(chunks[:2]), [0, SIZE], kv)
    loader.load(torch.cat(chunks[2:]), [0, SIZE], kv, first_chunk=2)
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer], want)


def test_reserve_sizes_the_reused_buffer_once() -> None:
    loader = KVLoader(FMT, torch.device("cpu"))
    loader.reserve(6)
    big = loader.alloc(6, reuse=True)
    assert loader.owns(big)
    # reserve writes every byte (fresh memory reads as zeros too, so mark it first to tell)
    big.fill_(1.0)
    loader.reserve(6)
    assert torch.count_nonzero(big) == 0
    small = loader.alloc(2, reuse=True)
    assert small.data_ptr() == big.data_ptr()  # a shorter prefix: the same buffer, not a new one
    assert small.shape[4] == 2 * FMT.chunk_tokens
    loader.reserve(0)  # nothing to do
    assert not loader.owns(loader.alloc(2))  # a fresh buffer is the caller's own


def test_layer_views_alias_the_buffer_and_are_kept_only_for_the_reused_one() -> None:
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(3, reuse=True)
    views = loader.layer_views(kv, 2)
    assert len(views) == FMT.layout.layers
    k, v = views[1]
    assert k.shape == (1, FMT.layout.kv_heads, 2 * FMT.chunk_tokens, FMT.layout.head_dim)
    kv[1, 1, 0, 0, 0, 0] = 7.0  # a view, not a copy
    assert v[0, 0, 0, 0] == 7.0
    assert loader.alloc(3, reuse=True) is kv and loader.layer_views(kv, 2) is views
    fresh = loader.alloc(3)
    assert loader.layer_views(fresh, 2) is not loader.layer_views(fresh, 2)
    bigger = loader.alloc(8, reuse=True)  # the buffer grew: nothing of the old one is kept
    assert loader.alloc(3, reuse=True) is not kv
    assert loader.layer_views(loader.alloc(3, reuse=True), 2) is not views
    assert loader.owns(bigger)


def test_misaligned_bytes_are_copied_right() -> None:
    fmt = ChunkFormat(KVLayout(2, 1, 4, "bfloat16"), 2)
    chunks = _chunks(2, seed=3, fmt=fmt)
    src = torch.zeros(1 + 2 * fmt.chunk_bytes, dtype=torch.uint8)  # odd offset for bf16
    src[1:] = torch.cat(chunks)
    loader = KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(2)
    loader.load(src, [1, 1 + fmt.chunk_bytes], kv)
    for layer, want in enumerate(_reference(chunks, fmt)):
        assert torch.equal(kv[layer], want)


def test_a_cpu_load_is_one_strided_copy_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = _chunks(3, seed=4)
    loader = KVLoader(FMT, torch.device("cpu"))
    monkeypatch.setattr(loader, "_copy_run", lambda *_a: pytest.fail("the op-by-op copy ran"))
    kv = loader.alloc(3, reuse=True)
    loader.load(torch.cat(chunks), [0, SIZE, 2 * SIZE], kv)
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer], want)


def test_views_kept_between_requests_copy_each_requests_own_chunks() -> None:
    """The reused buffer's target views and the arena's typed view are kept between loads
    (a cold request pays tens of microseconds per view made); a later load at other offsets,
    into a grown buffer or out of a remapped arena, still lands its own bytes."""
    chunks = _chunks(6, seed=8)
    loader = KVLoader(FMT, torch.device("cpu"))
    first = mmap.mmap(-1, 8 * SIZE)
    arena = loader.arena_tensor(first)
    for slot, chunk in enumerate(chunks):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk
    kv = loader.alloc(3, reuse=True)
    for slots in ([0, 1, 2], [3, 4, 5], [5, 0, 1]):
        loader.load(arena, [s * SIZE for s in slots], kv)
        for layer, want in enumerate(_reference([chunks[s] for s in slots])):
            assert torch.equal(kv[layer], want)
    assert loader._targets and all(key[0] == id(kv) for key in loader._targets)
    fresh = loader.alloc(3)  # the caller's own buffer: its views are not kept
    loader.load(arena, [0, SIZE, 2 * SIZE], fresh)
    assert all(key[0] == id(kv) for key in loader._targets)
    bigger = loader.alloc(6, reuse=True)  # the buffer grew: the old views go with it
    assert not loader._targets
    loader.load(arena, [s * SIZE for s in range(6)], bigger)
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(bigger[layer], want)
    second = mmap.mmap(-1, 8 * SIZE)  # a resized arena: a new mapping, its own typed view
    moved = loader.arena_tensor(second)
    assert loader._arena_typed is not None and loader._arena_typed[0] is moved
    moved[: 2 * SIZE] = torch.cat(chunks[4:])
    kv = loader.alloc(2, reuse=True)
    loader.load(moved, [0, SIZE], kv)
    for layer, want in enumerate(_reference(chunks[4:])):
        assert torch.equal(kv[layer], want)
    loader.close()
    assert loader._arena_typed is None


def test_a_source_that_starts_misaligned_is_copied_right() -> None:
    """Offsets aligned within a source slice that is not (a view one byte into a buffer): the
    bytes are copied, not viewed (the view used to raise)."""
    chunks = _chunks(2, seed=5)
    buf = torch.zeros(1 + 2 * SIZE, dtype=torch.uint8)
    buf[1:] = torch.cat(chunks)
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(2)
    loader.load(buf[1:], [0, SIZE], kv)
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer], want)


def test_a_destination_with_other_strides_is_copied_right() -> None:
    """A KV buffer whose heads' tokens are not back to back (every other head_dim slot of a
    wider one) takes the op-by-op copy, with the same result."""
    lay = FMT.layout
    chunks = _chunks(3, seed=6)
    wide = torch.zeros(
        (lay.layers, 2, 1, lay.kv_heads, 3 * FMT.chunk_tokens, 2 * lay.head_dim),
        dtype=FMT.dtype,
    )
    kv = wide[..., : lay.head_dim]
    loader = KVLoader(FMT, torch.device("cpu"))
    loader.load(torch.cat(chunks), [0, SIZE, 2 * SIZE], kv)
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer], want)
    assert torch.count_nonzero(wide[..., lay.head_dim :]) == 0


def test_chunks_past_the_source_or_the_buffer_are_refused_not_read_or_written() -> None:
    chunks = _chunks(2, seed=7)
    arena = torch.cat([*chunks, torch.full((SIZE,), 7, dtype=torch.uint8)])
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(2)
    with pytest.raises(RuntimeError):  # the second chunk would be read past the source
        loader.load(arena[: 2 * SIZE], [SIZE, 2 * SIZE], kv)
    with pytest.raises(RuntimeError):  # room for two chunks, not three
        loader.load(arena, [0, SIZE, 2 * SIZE], kv)
    # a buffer inside a bigger one: a chunk position before it is not written before it
    wide = loader.alloc(4)
    wide.zero_()
    inner = wide[:, :, :, :, 2 * FMT.chunk_tokens :, :]
    with pytest.raises((RuntimeError, IndexError)):
        loader.load(arena, [0], inner, first_chunk=-1)
    assert torch.count_nonzero(wide) == 0
    # a source that is not bytes is refused, not read as bytes
    with pytest.raises(RuntimeError):
        loader.load(arena.view(torch.float32), [SIZE], kv)


def test_host_tensor_aliases_a_read_only_mapping() -> None:
    fd = os.memfd_create("kvload-test")
    try:
        os.ftruncate(fd, 4096)
        writable = mmap.mmap(fd, 4096)
        readonly = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
        view = host_tensor(readonly)
        writable[100:104] = b"\x01\x02\x03\x04"
        # the tensor sees the write: no copy was made
        assert view[100:104].tolist() == [1, 2, 3, 4]
        del view
        readonly.close()
        writable.close()
    finally:
        os.close(fd)


def test_the_arena_tensor_is_made_once_per_mapping() -> None:
    loader = KVLoader(FMT, torch.device("cpu"))
    first = mmap.mmap(-1, 4096)
    second = mmap.mmap(-1, 8192)
    a = loader.arena_tensor(first)
    assert loader.arena_tensor(first) is a
    b = loader.arena_tensor(second)  # a resized arena: a new mapping, the old one forgotten
    assert b.numel() == 8192 and len(loader._registered) == 1
    loader.close()
    assert not loader._registered


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and madvise are Linux's")
def test_a_cpu_loader_faults_the_arena_mapping_in_until_it_is_forgotten() -> None:
    fd = os.memfd_create("kvload-populate-test")
    try:
        os.ftruncate(fd, 8 << 20)
        os.posix_fallocate(fd, 0, 8 << 20)
        arena = mmap.mmap(fd, 8 << 20, prot=mmap.PROT_READ)
        loader = KVLoader(FMT, torch.device("cpu"))
        loader.arena_tensor(arena)
        stop = loader._registered[id(arena)][2]
        prefault = getattr(stop, "__self__", None)
        assert isinstance(prefault, Prefaulter)
        prefault.join(30)
        if prefault.failed:
            pytest.skip(f"this kernel cannot prefault: {prefault.failed}")
        assert prefault.populated_bytes == 8 << 20
        loader.close()  # forgotten: populating stops (a new mapping gets its own)
        prefault.want(8 << 20)
        assert prefault._thread is None
        arena.close()
    finally:
        os.close(fd)


_SLOTS = {"adjacent": [0, 1, 2, 3, 4], "gaps": [5, 6, 0, 2, 3]}


@pytest.mark.parametrize("order", list(_SLOTS))
def test_layer_copies_fill_each_layer_when_asked_in_order(order: str) -> None:
    """``load_layers`` on the CPU copies nothing until a layer is asked for, then every layer
    up to it; what lands is what ``load`` lays out, bit for bit."""
    slots = _SLOTS[order]
    chunks = _chunks(len(slots), seed=8)
    arena = torch.zeros((max(slots) + 1) * SIZE, dtype=torch.uint8)
    for chunk, slot in zip(chunks, slots, strict=True):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk
    loader = KVLoader(FMT, torch.device("cpu"))
    kv = loader.alloc(len(slots))
    kv.fill_(float("nan"))
    copies = loader.load_layers(arena, [s * SIZE for s in slots], kv)
    want = _reference(chunks)
    assert torch.isnan(kv).all()  # queued, not copied
    copies.ready(0)
    assert torch.equal(kv[0], want[0]) and torch.isnan(kv[1:]).all()
    copies.ready(2)  # layer 1 on the way
    assert all(torch.equal(kv[i], want[i]) for i in range(3))
    copies.ready(1)  # asked again: nothing more to do
    copies.done()
    assert copies.seconds() > 0


def test_layer_copies_of_a_run_its_views_cannot_cover_land_whole_with_the_first_layer() -> None:
    """A source that is not a KV-dtype vector (odd start for bf16) takes the op-by-op copy of
    the whole run at the first layer's turn; the result is the same."""
    fmt = ChunkFormat(KVLayout(2, 1, 4, "bfloat16"), 2)
    chunks = _chunks(2, seed=9, fmt=fmt)
    src = torch.zeros(1 + 2 * fmt.chunk_bytes, dtype=torch.uint8)
    src[1:] = torch.cat(chunks)
    loader = KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(2)
    copies = loader.load_layers(src, [1, 1 + fmt.chunk_bytes], kv)
    copies.ready(0)
    for layer, want in enumerate(_reference(chunks, fmt)):
        assert torch.equal(kv[layer], want)
    copies.done()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layer_copies_are_bit_exact_and_ordered_by_events() -> None:
    slots = _SLOTS["gaps"]
    chunks = _chunks(len(slots), seed=10)
    arena = mmap.mmap(-1, (max(slots) + 1) * SIZE)
    for chunk, slot in zip(chunks, slots, strict=True):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk.numpy().tobytes()
    loader = KVLoader(FMT, torch.device("cuda"))
    src = loader.arena_tensor(arena)
    kv = loader.alloc(len(slots))
    copies = loader.load_layers(src, [s * SIZE for s in slots], kv)
    for layer, want in enumerate(_reference(chunks)):
        copies.ready(layer)  # the current stream waits for the layer's event
        assert torch.equal(kv[layer].cpu(), want)
    copies.done()
    assert copies.seconds() > 0
    loader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_from_a_registered_mapping_is_bit_exact() -> None:
    n = 5
    chunks = _chunks(n, seed=4)
    arena = mmap.mmap(-1, (n + 2) * SIZE)
    slots = [0, 1, 2, 4, 5]
    for chunk, slot in zip(chunks, slots, strict=True):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk.numpy().tobytes()
    loader = KVLoader(FMT, torch.device("cuda"))
    src = loader.arena_tensor(arena)
    assert loader.register_failures == 0
    kv = loader.alloc(n)
    loader.load(src, [s * SIZE for s in slots], kv)
    loader.wait()
    for layer, want in enumerate(_reference(chunks)):
        assert torch.equal(kv[layer].cpu(), want)
    loader.close()


def _leases(arena: mmap.mmap, slots: list[int | None]) -> ArenaLeases:
    chunks = [
        None if s is None else LeasedChunk(s * SIZE, SIZE, time.monotonic() + 60) for s in slots
    ]
    return ArenaLeases(arena, 1, chunks, frozenset(i for i, s in enumerate(slots) if s is None))


def test_loads_queued_together_land_each_their_own_chunks() -> None:
    """``queue_leased_many``: each load leased whole gets its layer copies (bit for bit what
    ``load`` lays out); one with a chunk not leased gets None, the others are queued still."""
    chunks = _chunks(6, seed=11)
    arena = mmap.mmap(-1, 8 * SIZE)
    for slot, chunk in enumerate(chunks):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk.numpy().tobytes()
    loader = KVLoader(FMT, torch.device("cpu"))
    wanted = [[4, 0], [1, 2, 3], [5, None]]
    kvs = [loader.alloc(len(slots)) for slots in wanted]
    loads = [(_leases(arena, slots), len(slots), kv) for slots, kv in zip(wanted, kvs, strict=True)]
    copies = queue_leased_many(loads, loader)
    assert copies[2] is None
    for slots, kv, queued in zip(wanted[:2], kvs, copies, strict=False):
        assert queued is not None and len(queued.leased) == len(slots)
        queued.done()
        assert queued.held() == len(slots)
        for layer, want in enumerate(_reference([chunks[s] for s in slots])):  # type: ignore[index]
            assert torch.equal(kv[layer], want)
    loader.close()


def _slow_cuda_loader(monkeypatch: pytest.MonkeyPatch, fail_at: int) -> KVLoader:
    """A CUDA loader whose side stream is held behind ~1 s of device work on the caller's
    stream (so queued copies are still pending when queueing fails) and whose ``fail_at``-th
    queueing step raises, as a scratch buffer the device has no room for would."""
    loader = KVLoader(FMT, torch.device("cuda"))
    calls = [0]
    for name in ("_queue_layer", "_copy_whole"):
        real = getattr(loader, name)

        def failing(*args: object, _real: object = real) -> None:
            calls[0] += 1
            if calls[0] == fail_at:
                raise torch.OutOfMemoryError("no room for a scratch buffer (test)")
            _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(loader, name, failing)
    torch.cuda._sleep(2_000_000_000)  # on the current stream, which the side stream waits for
    return loader


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ["load", "load_layers"])
def test_cuda_copies_queued_before_a_failure_are_over_when_it_is_raised(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The caller releases the leases and drops the buffer on an error: nothing queued may
    still be reading or writing them then."""
    slots = [0, 2, 4]  # three runs: the second one's queueing fails
    chunks = _chunks(len(slots), seed=12)
    arena = mmap.mmap(-1, 6 * SIZE)
    for chunk, slot in zip(chunks, slots, strict=True):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk.numpy().tobytes()
    loader = _slow_cuda_loader(monkeypatch, fail_at=2)
    src = loader.arena_tensor(arena)
    kv = loader.alloc(len(slots))
    with pytest.raises(torch.OutOfMemoryError):
        if how == "load":
            loader.load(src, [s * SIZE for s in slots], kv)
        else:
            loader.load_layers(src, [s * SIZE for s in slots], kv)
    assert loader._stream.query()  # every queued copy has ended
    loader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_loads_queued_together_are_layer_major_and_bit_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every load's layer l is queued before any load's layer l + 1 (one side stream runs in
    order: the first attention layer must not wait for a whole earlier prefix)."""
    chunks = _chunks(5, seed=13)
    arena = mmap.mmap(-1, 6 * SIZE)
    for slot, chunk in enumerate(chunks):
        arena[slot * SIZE : (slot + 1) * SIZE] = chunk.numpy().tobytes()
    loader = KVLoader(FMT, torch.device("cuda"))
    order: list[tuple[int, int]] = []
    real = loader._queue_layer

    def logged(src: torch.Tensor, offsets: list[int], dst: torch.Tensor, layer: int) -> None:
        order.append((layer, len(offsets)))
        real(src, offsets, dst, layer)

    monkeypatch.setattr(loader, "_queue_layer", logged)
    src = loader.arena_tensor(arena)
    wanted = [[3, 0], [1, 2, 4]]
    kvs = [loader.alloc(len(s)) for s in wanted]
    copies = loader.load_layers_many(
        [(src, [s * SIZE for s in slots], kv) for slots, kv in zip(wanted, kvs, strict=True)]
    )
    layers = FMT.layout.layers
    assert order == [(layer, n) for layer in range(layers) for n in (2, 3)]
    for slots, kv, queued in zip(wanted, kvs, copies, strict=True):
        for layer, want in enumerate(_reference([chunks[s] for s in slots])):
            queued.ready(layer)
            assert torch.equal(kv[layer].cpu(), want)
        queued.done()
    loader.close()
