"""Model and GPU profiles: the inputs of every modeled figure (prefill time, energy, KV bytes).

Figures derived from these are *modeled*, not measured: whoever shows one also shows the
profile names and the MFU it assumed (``ModeledInputs``).

- KV bytes per token = layers x kv heads x head dim x 2 (K and V) x dtype bytes, from each
  model's published config.
- Prefill FLOPs per token = 2 x parameters: the dense matmuls. Attention over the prefix adds
  ``4 x layers x hidden x context`` per token, which this model leaves out, so long prompts are
  under-costed and the modeled savings of reusing them are conservative.
- Peak TFLOP/s are the vendors' dense bf16 figures (no sparsity); board power is the typical
  board power (TDP) of the SXM part (the L4 is PCIe only), each cited in
  :data:`BOARD_POWER_SOURCES`. Prefill runs near the board's limit, so energy = prefill seconds
  x board power; where NVML is absent the collector can emulate a node's GPU energy that way
  (``kvctl collect --emulate-power``), labelled emulated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout

#: the fraction of peak FLOP/s prefill reaches (model FLOPs utilisation); 0.5 is typical of
#: long-prompt prefill in vLLM and SGLang on H100, and an input the user can change
DEFAULT_MFU = 0.5
#: light in fiber: about 5 microseconds per km, one way (the floor under any link's RTT)
FIBER_SECONDS_PER_KM = 5e-6
#: no fiber path between two DCs is longer than the Earth's circumference; past it a distance
#: is a typo (1e308 km printed a 300-digit fetch time). `kvctl plan` and the fleet inventory
#: both bound distances by it
MAX_DISTANCE_KM = 40_075.0


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float
    dtype: str = "bfloat16"

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def prefill_flops_per_token(self) -> float:
        return 2.0 * self.params

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill_flops_per_token": self.prefill_flops_per_token,
        }


@dataclass(frozen=True, slots=True)
class GPUProfile:
    name: str
    peak_bf16_tflops: float
    board_power_watts: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, params=8.03e9),
        ModelProfile("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128, params=70.6e9),
        ModelProfile("mistral-7b", layers=32, kv_heads=8, head_dim=128, params=7.25e9),
        ModelProfile("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128, params=7.62e9),
        # small enough for a laptop demo (and for issue 10's seeded transformers model)
        ModelProfile("qwen2.5-0.5b", layers=24, kv_heads=2, head_dim=64, params=0.494e9),
    )
}

GPUS: dict[str, GPUProfile] = {
    p.name: p
    for p in (
        GPUProfile("a100", peak_bf16_tflops=312.0, board_power_watts=400.0),
        GPUProfile("h100", peak_bf16_tflops=989.0, board_power_watts=700.0),
        GPUProfile("h200", peak_bf16_tflops=989.0, board_power_watts=700.0),
        GPUProfile("l4", peak_bf16_tflops=121.0, board_power_watts=72.0),
    )
}

#: where each profile's ``board_power_watts`` is published (shown beside emulated energy)
BOARD_POWER_SOURCES: dict[str, str] = {
    "a100": "NVIDIA A100 datasheet: 400 W max TDP (SXM4)",
    "h100": "NVIDIA H100 datasheet: up to 700 W max TDP (SXM5)",
    "h200": "NVIDIA H200 datasheet: up to 700 W max TDP (SXM)",
    "l4": "NVIDIA L4 datasheet: 72 W max TDP",
}

DEFAULT_MODEL = "llama-3.1-8b"
DEMO_MODEL = "qwen2.5-0.5b"
DEFAULT_GPU = "h100"


def _pick(table: dict[str, object], name: str, what: str) -> object:
    try:
        return table[name.lower()]
    except KeyError:
        raise InvalidArgument(f"unknown {what} {name!r}; choose from {', '.join(table)}") from None


def model_profile(name: str) -> ModelProfile:
    return _pick(MODELS, name, "model")  # type: ignore[return-value,arg-type]


def gpu_profile(name: str) -> GPUProfile:
    return _pick(GPUS, name, "GPU")  # type: ignore[return-value,arg-type]


@dataclass(frozen=True, slots=True)
class ModeledInputs:
    """Everything a modeled prefill figure depends on, shown next to the figure."""

    model: ModelProfile
    gpu: GPUProfile
    mfu: float = DEFAULT_MFU

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise InvalidArgument(f"MFU must be in (0, 1], got {self.mfu}")

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.gpu.peak_bf16_tflops * 1e12 * self.mfu / self.model.prefill_flops_per_token

    def prefill_seconds(self, tokens: float) -> float:
        return tokens / self.prefill_tokens_per_second

    def prefill_joules(self, tokens: float) -> float:
        return self.prefill_seconds(tokens) * self.gpu.board_power_watts

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model.as_dict(),
            "gpu": self.gpu.as_dict(),
            "mfu": self.mfu,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "basis": "modeled: prefill FLOPs = 2 x params per token; energy = time x board power",
        }
