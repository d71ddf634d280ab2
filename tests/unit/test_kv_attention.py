"""The reference engine's attention (kvctl.engines.attention) computes what transformers' own
eager attention does, with its explicit causal mask: a full prefill, a prefill on top of cached
KV (fewer queries than keys, the case it exists for) and decode steps; and it refuses a mask
rather than ignore one. fp32 on the CPU, so the tolerance is rounding alone."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvctl.engines.attention import KV_ATTENTION, kv_attention  # noqa: E402
from kvctl.engines.models import build_model  # noqa: E402

ATOL = 2e-5


def _tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (1, n), generator=g)


@torch.inference_mode()
def _run(model: torch.nn.Module, implementation: str, ids: torch.Tensor, split: int) -> list:
    """Logits of a prefill of ``ids[:split]``, then the rest on its cache, then two decode
    steps: every shape of attention an engine asks for."""
    model.set_attn_implementation(implementation)
    # the cache argument's name changed in transformers 5.x (as kvctl.engines.hf handles it)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {name: DynamicCache()}
    out = model(input_ids=ids[:, :split], use_cache=True, **kv)
    logits = [out.logits[0, -1]]
    out = model(input_ids=ids[:, split:], use_cache=True, **kv)
    logits.append(out.logits[0])  # every position of the continuation, not only the last
    for _ in range(2):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=nxt, use_cache=True, **kv)
        logits.append(out.logits[0, -1])
    return logits


def test_models_built_here_use_it() -> None:
    model = build_model("tiny-llama", seed=0)
    assert model.config._attn_implementation == KV_ATTENTION


@pytest.mark.parametrize("split", [1, 37, 128])
def test_it_matches_eager_attention_with_its_mask(split: int) -> None:
    model = build_model("tiny-llama", seed=3)  # GQA: 4 query heads over 2 KV heads
    ids = _tokens(200, split)
    ours = _run(model, KV_ATTENTION, ids, split)
    eager = _run(model, "eager", ids, split)
    for got, want in zip(ours, eager, strict=True):
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() <= ATOL


def test_a_mask_is_refused_not_ignored() -> None:
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="no attention mask"):
        kv_attention(torch.nn.Module(), q, kv, kv, torch.ones(1, 1, 3, 5, dtype=torch.bool))
