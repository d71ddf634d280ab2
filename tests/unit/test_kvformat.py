"""The shared chunk byte layout: pack and unpack are inverse, and the layout is the documented
``[layers, 2, kv_heads, T, head_dim]``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.engines.kvformat import ChunkFormat, dtype_name, torch_dtype  # noqa: E402
from kvctl.errors import InvalidArgument  # noqa: E402
from kvctl.store.keys import KVLayout  # noqa: E402


def _caches(layout: KVLayout, tokens: int, seed: int = 0) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.kv_heads, tokens, layout.head_dim)
    dtype = torch_dtype(layout.dtype)
    ks = [torch.randn(shape, generator=g).to(dtype) for _ in range(layout.layers)]
    vs = [torch.randn(shape, generator=g).to(dtype) for _ in range(layout.layers)]
    return ks, vs


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_pack_then_unpack_gives_the_caches_back(dtype: str) -> None:
    layout = KVLayout(3, 2, 8, dtype)
    fmt = ChunkFormat(layout, 4)
    ks, vs = _caches(layout, 13)
    packed = [fmt.pack(ks, vs, i) for i in range(3)]  # 12 tokens in 3 chunks; the tail is left
    assert all(
        p.numel() == fmt.chunk_bytes == 3 * 2 * 2 * 8 * 4 * layout.dtype_bytes for p in packed
    )
    for layer, (k, v) in enumerate(fmt.unpack(torch.cat(packed), 3)):
        assert torch.equal(k, ks[layer][:, :, :12]) and torch.equal(v, vs[layer][:, :, :12])


def test_the_byte_layout_is_layer_kv_head_token_dim() -> None:
    layout = KVLayout(2, 2, 3, "float32")
    fmt = ChunkFormat(layout, 2)
    ks, vs = _caches(layout, 4)
    block = fmt.pack(ks, vs, 1).view(torch.float32).reshape(2, 2, 2, 2, 3)
    assert torch.equal(block[1, 0, 1, 0], ks[1][0, 1, 2])  # layer 1, K, head 1, token 2
    assert torch.equal(block[0, 1, 0, 1], vs[0][0, 0, 3])  # layer 0, V, head 0, token 3


def test_bad_shapes_sizes_and_dtypes_are_refused() -> None:
    layout = KVLayout(2, 2, 4, "float32")
    fmt = ChunkFormat(layout, 4)
    ks, vs = _caches(layout, 6)
    with pytest.raises(InvalidArgument, match="ends at token 8"):
        fmt.pack(ks, vs, 1)
    with pytest.raises(InvalidArgument, match="expected 2 layers"):
        fmt.pack(ks[:1], vs[:1], 0)
    with pytest.raises(InvalidArgument, match="does not match"):
        fmt.pack([k.half() for k in ks], vs, 0)
    with pytest.raises(InvalidArgument, match="shaped"):
        fmt.pack([k[:, :1] for k in ks], vs, 0)
    with pytest.raises(InvalidArgument, match="bytes, got"):
        fmt.unpack(torch.zeros(fmt.chunk_bytes - 1, dtype=torch.uint8), 1)
    with pytest.raises(InvalidArgument, match="flat uint8"):
        fmt.unpack(torch.zeros(4), 1)
    with pytest.raises(InvalidArgument, match="not supported"):
        ChunkFormat(KVLayout(1, 1, 1, "fp8"), 4)
    with pytest.raises(InvalidArgument, match="not supported"):
        dtype_name(torch.int8)
    assert fmt.unpack(torch.zeros(0, dtype=torch.uint8), 0) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_into_writes_the_same_bytes_as_pack_in_place(dtype: str) -> None:
    layout = KVLayout(3, 2, 8, dtype)
    fmt = ChunkFormat(layout, 4)
    ks, vs = _caches(layout, 13)
    # chunks back to back in one buffer, as in a staging segment; the neighbours are untouched
    out = torch.full((4 * fmt.chunk_bytes,), 7, dtype=torch.uint8)
    for i in range(3):
        fmt.pack_into(ks, vs, i, out[i * fmt.chunk_bytes : (i + 1) * fmt.chunk_bytes])
    for i in range(3):
        assert torch.equal(
            out[i * fmt.chunk_bytes : (i + 1) * fmt.chunk_bytes], fmt.pack(ks, vs, i)
        )
    assert bool((out[3 * fmt.chunk_bytes :] == 7).all())
    with pytest.raises(InvalidArgument, match="flat uint8 tensor of"):
        fmt.pack_into(ks, vs, 0, out[: fmt.chunk_bytes - 1])
    with pytest.raises(InvalidArgument, match="ends at token 16"):
        fmt.pack_into(ks, vs, 3, out[: fmt.chunk_bytes])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_of_chunks_packs_as_each_chunk_would_back_to_back(dtype: str) -> None:
    layout = KVLayout(3, 2, 8, dtype)
    fmt = ChunkFormat(layout, 4)
    ks, vs = _caches(layout, 17)  # four whole chunks and a token
    one_by_one = torch.cat([fmt.pack(ks, vs, i) for i in range(4)])
    out = torch.full((5 * fmt.chunk_bytes,), 7, dtype=torch.uint8)
    fmt.pack_into(ks, vs, 1, out[: 3 * fmt.chunk_bytes], count=3)
    assert torch.equal(out[: 3 * fmt.chunk_bytes], one_by_one[fmt.chunk_bytes :])
    assert bool((out[3 * fmt.chunk_bytes :] == 7).all())  # nothing past the run
    assert torch.equal(fmt.pack(ks, vs, 0, count=4), one_by_one)
    with pytest.raises(InvalidArgument, match="3 chunk"):
        fmt.pack_into(ks, vs, 0, out[: 2 * fmt.chunk_bytes], count=3)
    with pytest.raises(InvalidArgument, match="ends at token 20"):
        fmt.pack_into(ks, vs, 2, out[: 3 * fmt.chunk_bytes], count=3)
    with pytest.raises(InvalidArgument, match="0 chunk"):
        fmt.pack_into(ks, vs, 0, out[:0], count=0)
