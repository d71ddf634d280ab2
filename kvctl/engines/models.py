"""Llama-architecture models built from a config with seeded random weights (nothing downloads).

The weights are random, so outputs are meaningless as text, but every tensor shape, KV size and
FLOP is the real model's: enough to prove that reused KV gives the same output as a full
prefill, and to time prefill on real shapes.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvctl.engines.attention import KV_ATTENTION
from kvctl.engines.shapes import SHAPES, ModelShape
from kvctl.errors import InvalidArgument


def llama_config(shape: str | ModelShape, *, seed: int = 0) -> LlamaConfig:
    """The config of a named shape; its ``name_or_path`` carries the seed, because two models
    with the same shape but different weights must never share KV (the model id is in every
    chunk key's root)."""
    s = SHAPES.get(shape) if isinstance(shape, str) else shape
    if s is None:
        raise InvalidArgument(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
    rope_scaling = (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if s.llama3_rope
        else None
    )
    cfg = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=s.max_positions,
        rope_theta=s.rope_theta,
        rope_scaling=rope_scaling,
        # SDPA with GQA in the kernel and end-aligned causality (kvctl.engines.attention):
        # a prefill after reused chunks runs the fused kernel, as a full prefill does
        attn_implementation=KV_ATTENTION,
    )
    cfg.name_or_path = f"kvctl/{s.name}-random-seed{seed}"
    return cfg


def build_model(
    shape: str | ModelShape | LlamaConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """A model with weights drawn from ``seed`` on ``device``.

    The same seed gives the same weights only on the same kind of device with the same torch
    (CPU and CUDA draw different streams), so a config built here gets a model id naming all
    three: two builds that could differ never share KV."""
    cfg = shape if isinstance(shape, LlamaConfig) else llama_config(shape, seed=seed)
    kind = torch.device(device).type
    if not isinstance(shape, LlamaConfig):
        cfg.name_or_path = f"{cfg.name_or_path}-{kind}-torch{torch.__version__}"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype=dtype).eval()
