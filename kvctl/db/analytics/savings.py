"""Efficiency accounting (design.md §5): what the cache's measured hits are worth.

Measured: tokens of the hits (agent counters, at lookup), energy (NVML), TTFT (engine metrics).
Modeled: what serving those tokens by prefill would have cost, from a model profile and each
node's GPU profile: GPU-seconds = tokens / prefill rate; IT energy = GPU-seconds x board power;
facility energy = IT energy x the DC's PUE; carbon = facility kWh x the DC's grid intensity.

Where the agents report their fetch-or-recompute figures (``kvctl_plan_saved_seconds_total``,
``/v1/stats`` ``fetch_plans.plans.saved_s``), GPU-seconds saved are those instead: each chunk
taken's prefill time minus the time fetching it took, from the same measured or configured
rates the agent decided with (a hit that was not worth fetching is neither taken nor counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from kvctl.profiles import GPUS, GPUProfile, ModeledInputs

JOULES_PER_KWH: Final = 3.6e6
# most specific first: "H200" must not read as "H20", nor "L40S" as "L4"
_GPU_PATTERNS: Final = tuple(
    (name, re.compile(rf"(?<![a-z0-9]){name}(?![a-z0-9])", re.IGNORECASE)) for name in GPUS
)


def gpu_key(gpu_model: str) -> str | None:
    """The GPU profile a node's reported GPU model names (``"NVIDIA H100 80GB HBM3"`` is
    ``h100``); None when no profile matches."""
    for name, pattern in _GPU_PATTERNS:
        if pattern.search(gpu_model or ""):
            return name
    return None


@dataclass(frozen=True, slots=True)
class Savings:
    """Modeled savings of serving ``tokens`` from cache instead of prefill on one GPU kind."""

    tokens: int
    gpu_seconds: float
    it_joules: float
    #: IT energy x PUE; equals IT energy when the DC's PUE is unknown (``pue_known`` False)
    facility_joules: float
    #: None when the DC's grid carbon intensity is unknown
    carbon_g: float | None
    pue_known: bool
    #: "plan": the agents' prefill time minus fetch time of the chunks taken (a measurement
    #: only where the agents' prefill rate was measured, not configured or modeled: see
    #: ``plan_sample.prefill_basis``); "modeled": tokens / the profile's prefill rate (fetch
    #: time not deducted)
    basis: str = "modeled"


def savings(
    tokens: int,
    inputs: ModeledInputs,
    *,
    pue: float | None,
    carbon_g_per_kwh: float | None,
    plan_saved_s: float | None = None,
    plan_gpu: GPUProfile | None = None,
) -> Savings:
    """What serving ``tokens`` from cache saved. ``plan_saved_s``: the agents' own figure
    (prefill minus fetch time of the chunks their plans took), used instead of the modeled
    prefill time when given; never negative, since a plan takes nothing that loses time.
    ``plan_gpu``: the GPU those seconds are of (the profile the agent's prefill rate was
    modeled on); its board power prices them, not ``inputs.gpu``'s, since seconds of an
    H100 at an L4's watts are neither GPU's energy."""
    gpu = inputs.gpu
    if plan_saved_s is None:
        gpu_seconds, basis = inputs.prefill_seconds(tokens), "modeled"
    else:
        gpu_seconds, basis = max(float(plan_saved_s), 0.0), "plan"
        gpu = plan_gpu or gpu
    it_joules = gpu_seconds * gpu.board_power_watts
    facility = it_joules * (pue if pue is not None else 1.0)
    carbon = None if carbon_g_per_kwh is None else facility / JOULES_PER_KWH * carbon_g_per_kwh
    return Savings(
        tokens=tokens,
        gpu_seconds=gpu_seconds,
        it_joules=it_joules,
        facility_joules=facility,
        carbon_g=carbon,
        pue_known=pue is not None,
        basis=basis,
    )
