"""vLLM's paged KV caches in kvctl's chunk layout: the geometry a connector must agree on with
the agent (whole blocks per chunk, the last prompt token never loaded, the cache dtype, layers
in model order), the per-layer cache layouts vLLM's attention backends use, and the copies
between a request's blocks and ``[layers, 2, kv_heads, tokens, head_dim]`` KV.

Nothing here imports vLLM or speaks to an agent; ``kvctl.engines.vllm_plan`` decides what to
load and save and moves the bytes.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

import torch

from kvctl.engines.kvformat import ChunkFormat, dtype_name
from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout


# --- geometry -----------------------------------------------------------------------------
def check_geometry(chunk_tokens: int, block_size: int) -> None:
    """A chunk must be whole vLLM blocks: loads fill whole blocks and saves read whole ones."""
    if block_size <= 0:
        raise InvalidArgument(f"vLLM's block_size must be positive, got {block_size}")
    if chunk_tokens <= 0 or chunk_tokens % block_size:
        raise InvalidArgument(
            f"the agent's chunk_tokens ({chunk_tokens}) must be a positive multiple of vLLM's "
            f"block_size ({block_size}): set the agent's chunk_tokens (or the connector's "
            "'chunk_tokens') to a multiple, or start vLLM with another --block-size"
        )


def loadable_chunks(prompt_tokens: int, chunk_tokens: int) -> int:
    """Whole chunks a request may load: the last prompt token is always left to compute (its
    logits are the next token), so a prompt of exactly k chunks may load k - 1."""
    return max(prompt_tokens - 1, 0) // chunk_tokens


#: vLLM ``--kv-cache-dtype`` values the chunk format can hold, by their kvctl names
_CACHE_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                 "float": "float32", "float32": "float32"}  # fmt: skip


def kv_layout(
    layers: int, kv_heads: int, head_dim: int, cache_dtype: str, model_dtype: torch.dtype
) -> KVLayout:
    """The chunk layout of a model as vLLM caches it; ``cache_dtype`` is vLLM's
    ``--kv-cache-dtype`` ("auto" means the model's dtype). Quantized (fp8) caches are refused:
    the shared chunk format has no scales."""
    if cache_dtype == "auto":
        dtype = dtype_name(model_dtype)
    elif cache_dtype in _CACHE_DTYPES:
        dtype = _CACHE_DTYPES[cache_dtype]
    else:
        raise InvalidArgument(
            f"KV cache dtype {cache_dtype!r} is not supported by the kvctl connector (fp8 caches "
            "carry scales the shared chunk format lacks); use --kv-cache-dtype auto"
        )
    return KVLayout(layers, kv_heads, head_dim, dtype)


def order_layers(names: Sequence[str]) -> list[str]:
    """Attention layer names in model order (by the one layer number in each name, as in
    ``model.layers.7.self_attn.attn``): chunks hold layers in model order, dicts need not."""
    indexed: list[tuple[int, str]] = []
    for name in names:
        numbers = re.findall(r"\d+", name)
        if len(numbers) != 1:
            raise InvalidArgument(
                f"cannot tell the layer number of KV cache {name!r}: expected one number in it"
            )
        indexed.append((int(numbers[0]), name))
    indexed.sort()
    order = [i for i, _ in indexed]
    if order != list(range(len(order))):
        raise InvalidArgument(f"KV cache layers are not numbered 0..{len(order) - 1}: {order}")
    return [name for _, name in indexed]


# --- paged caches -------------------------------------------------------------------------
class CacheLayout(enum.Enum):
    """Per-layer paged KV layouts of vLLM's attention backends (logical shapes; the physical
    stride order may differ, which indexing does not see)."""

    #: ``[2, num_blocks, block_size, kv_heads, head_dim]``: FlashAttention (and most backends)
    #: before vLLM's 2026 KV-layout refactor
    KV_FIRST = "2BNHD"
    #: ``[num_blocks, 2, block_size, kv_heads, head_dim]``: FlashInfer before the refactor
    BLOCKS_FIRST = "B2NHD"
    #: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, K then V in the last dimension:
    #: the standardized layout after the refactor (vLLM PRs 44455 and 51718)
    PACKED = "BHNC"


def detect_layout(shape: Sequence[int], kv_heads: int, head_dim: int) -> tuple[CacheLayout, int]:
    """The layout of one layer's paged cache and its (kernel) block size, from its shape."""
    s = tuple(int(x) for x in shape)
    found: list[tuple[CacheLayout, int]] = []
    if len(s) == 5 and s[3] == kv_heads and s[4] == head_dim:
        if s[0] == 2:
            found.append((CacheLayout.KV_FIRST, s[2]))
        if s[1] == 2:
            found.append((CacheLayout.BLOCKS_FIRST, s[2]))
    elif len(s) == 4 and s[1] == kv_heads and s[3] == 2 * head_dim:
        found.append((CacheLayout.PACKED, s[2]))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise InvalidArgument(f"KV cache shape {list(s)} fits both {found[0][0].value} and "
                              f"{found[1][0].value}; cannot tell which")  # fmt: skip
    if len(s) == 3 or (len(s) == 4 and s[1] == 1 and s[3] != 2 * head_dim):
        raise InvalidArgument(
            f"KV cache shape {list(s)} looks like MLA (one latent vector per token, no K/V "
            "heads): the kvctl chunk format holds K and V per head, so MLA models are not supported"
        )
    raise InvalidArgument(
        f"unsupported KV cache shape {list(s)} for {kv_heads} kv heads of {head_dim}: expected "
        f"[2, blocks, block_size, {kv_heads}, {head_dim}], [blocks, 2, block_size, {kv_heads}, "
        f"{head_dim}] or [blocks, {kv_heads}, block_size, {2 * head_dim}]"
    )


def token_slots(
    block_ids: Sequence[int], start: int, end: int, block_size: int, kernel_block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block index, offset in block) of tokens ``start..end`` of a request whose KV lives in
    ``block_ids`` (vLLM's blocks, ``block_size`` tokens each). When the attention kernel pages
    smaller blocks than the scheduler (``kernel_block_size``), scheduler block b is kernel
    blocks ``b*r .. b*r + r-1``."""
    if not 0 <= start <= end:
        raise InvalidArgument(f"bad token range {start}..{end}")
    if end > len(block_ids) * block_size:
        raise InvalidArgument(
            f"tokens up to {end} need {-(-end // block_size)} blocks of {block_size}; "
            f"the request has {len(block_ids)}"
        )
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise InvalidArgument(
            f"the cache's block size {kernel_block_size} does not divide vLLM's {block_size}"
        )
    t = torch.arange(start, end, dtype=torch.long)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)[t // block_size]
    within = t % block_size
    ratio = block_size // kernel_block_size
    return blocks * ratio + within // kernel_block_size, within % kernel_block_size


class PagedKV:
    """Every attention layer's paged cache of one worker, in model order, read and written in
    the shared chunk layout."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int) -> None:
        if len(layers) != layout.layers:
            raise InvalidArgument(
                f"the model has {layout.layers} layers but {len(layers)} KV caches were registered "
                "(hybrid or cross-layer-shared caches are not supported)"
            )
        self.layers = list(layers)
        self.layout = layout
        self.block_size = block_size
        self.cache_layout, self.kernel_block_size = detect_layout(
            self.layers[0].shape, layout.kv_heads, layout.head_dim
        )
        self.dtype = ChunkFormat(layout, 1).dtype
        for i, t in enumerate(self.layers):
            if t.shape != self.layers[0].shape or t.dtype != self.dtype:
                raise InvalidArgument(
                    f"layer {i}'s cache is {list(t.shape)} {t.dtype}; layer 0's is "
                    f"{list(self.layers[0].shape)} and the layout says {self.dtype}"
                )
        # a wrong block id would fault on the device; refuse it on the host instead
        blocks = self.layers[0].shape[1 if self.cache_layout is CacheLayout.KV_FIRST else 0]
        self.num_blocks = int(blocks) * self.kernel_block_size // block_size
        self.device = self.layers[0].device
        token_slots((), 0, 0, block_size, self.kernel_block_size)  # validates the block sizes

    def slots(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset in it) of tokens ``start..end`` of a request whose blocks are
        ``block_ids``, on the cache's device."""
        ids = list(block_ids)[: -(-end // self.block_size)]
        if ids and not 0 <= min(ids) <= max(ids) < self.num_blocks:
            raise InvalidArgument(f"block ids must be in 0..{self.num_blocks - 1}")
        blk, off = token_slots(ids, start, end, self.block_size, self.kernel_block_size)
        if self.device.type == "cuda":  # a pageable copy would wait for the stream's work
            return (
                blk.pin_memory().to(self.device, non_blocking=True),
                off.pin_memory().to(self.device, non_blocking=True),
            )
        return blk, off

    def gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV of tokens ``start..end`` as ``[layers, 2, kv_heads, end-start, head_dim]``."""
        blk, off = self.slots(block_ids, start, end)
        return torch.stack([self._gather_layer(t, blk, off) for t in self.layers])

    def scatter(
        self,
        block_ids: Sequence[int],
        start: int,
        kv: torch.Tensor,
        layers: Sequence[int] | None = None,
        slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write ``kv`` (``[layers, 2, kv_heads, T, head_dim]``) as tokens ``start..start+T``:
        every layer, or only ``layers``. ``slots``: ``slots(block_ids, start, start+T)`` made
        once by a caller that writes the same tokens one layer at a time."""
        lay = self.layout
        expected = (lay.layers, 2, lay.kv_heads, lay.head_dim)
        if kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != expected:
            raise InvalidArgument(
                f"expected KV shaped [{lay.layers}, 2, {lay.kv_heads}, tokens, {lay.head_dim}], "
                f"got {list(kv.shape)}"
            )
        blk, off = slots or self.slots(block_ids, start, start + kv.shape[3])
        kv = kv.to(device=self.device, dtype=self.dtype)
        for i in range(lay.layers) if layers is None else layers:
            self._scatter_layer(self.layers[i], blk, off, kv[i])

    def gather_chunks(
        self, block_ids: Sequence[int], first_chunk: int, chunks: int, chunk_tokens: int
    ) -> torch.Tensor:
        """Chunks ``first_chunk ..`` as ``[chunks, chunk_bytes]`` uint8 on the cache's device,
        each row the chunk's bytes in the shared layout (``ChunkFormat``)."""
        lay = self.layout
        kv = self.gather(
            block_ids, first_chunk * chunk_tokens, (first_chunk + chunks) * chunk_tokens
        )
        # [L, 2, H, n*T, D] -> [n, L, 2, H, T, D]: one copy, each chunk contiguous
        split = kv.reshape(lay.layers, 2, lay.kv_heads, chunks, chunk_tokens, lay.head_dim)
        rows = split.permute(3, 0, 1, 2, 4, 5).contiguous()
        return rows.view(torch.uint8).reshape(chunks, -1)

    def scatter_loaded(
        self, block_ids: Sequence[int], kv: torch.Tensor, chunk_tokens: int, first_chunk: int,
        start: int, end: int, layers: Sequence[int] | None = None,
        slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """Write tokens ``start..end`` from ``kv``, consecutive chunks from ``first_chunk`` as a
        ``KVLoader`` lays them out (``[layers, 2, 1, heads, chunks*T, dim]``). Tokens outside the
        range are not written, so blocks vLLM already holds stay untouched. ``layers`` and
        ``slots`` as for ``scatter``."""
        base = first_chunk * chunk_tokens
        if not base <= start <= end <= base + kv.shape[4]:
            raise InvalidArgument(
                f"tokens {start}..{end} are not within chunks {first_chunk}.."
                f"{first_chunk + kv.shape[4] // chunk_tokens}"
            )
        self.scatter(block_ids, start, kv[:, :, 0, :, start - base : end - base], layers, slots)

    def _gather_layer(self, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        if self.cache_layout is CacheLayout.KV_FIRST:
            return t[:, blk, off].permute(0, 2, 1, 3)  # [2, T, H, D] -> [2, H, T, D]
        if self.cache_layout is CacheLayout.BLOCKS_FIRST:
            return t[blk, :, off].permute(1, 2, 0, 3)  # [T, 2, H, D] -> [2, H, T, D]
        tokens = t[blk, :, off]  # [T, H, 2D], K then V
        return tokens.reshape(tokens.shape[0], tokens.shape[1], 2, -1).permute(2, 1, 0, 3)

    def _scatter_layer(
        self, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, kv: torch.Tensor
    ) -> None:
        if self.cache_layout is CacheLayout.KV_FIRST:
            t[:, blk, off] = kv.permute(0, 2, 1, 3)
        elif self.cache_layout is CacheLayout.BLOCKS_FIRST:
            t[blk, :, off] = kv.permute(2, 0, 1, 3)
        else:
            tokens = kv.permute(2, 1, 0, 3)  # [T, H, 2, D]
            t[blk, :, off] = tokens.reshape(tokens.shape[0], tokens.shape[1], -1)
