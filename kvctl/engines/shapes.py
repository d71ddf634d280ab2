"""The model shapes kvctl builds (published configs, random weights), apart from torch: a
command can refuse a name it does not know before paying seconds of torch imports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float = 10000.0
    llama3_rope: bool = False


SHAPES: dict[str, ModelShape] = {
    # small enough that a 16k-token prefill takes seconds on 2 CPU cores, GQA like the real ones
    "tiny-llama": ModelShape("tiny-llama", 256, 4, 4, 2, 688, 32000, 131072),
    # Llama-3.1-8B's published config (random weights): real KV sizes and prefill FLOPs on a GPU
    "llama-3.1-8b": ModelShape(
        "llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, llama3_rope=True
    ),
}
