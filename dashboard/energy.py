"""What the energy and savings cards say about their inputs: which model and GPU the agents'
plans priced their seconds from, whose board power turned them into joules, and where those
differ from the page's chosen inputs or the inventory (said, never mixed silently). Every
energy figure names its basis: IT (the GPU boards) or facility (IT x the DC's PUE)."""

from __future__ import annotations

from typing import Any, Final

from kvctl.format import ENERGY_UNITS, common_scale, format_seconds
from kvctl.profiles import GPUS

#: the two bases of an energy figure; the cards' titles carry them
IT: Final = "IT"
FACILITY: Final = "facility (x PUE)"
#: how many named items a note lists before "+N more"
NOTE_ITEMS: Final = 3


def energy_units(c: Any) -> tuple[tuple[float, str]]:
    """The one unit of a page's energy cards (saved, used, emulated used), so adjacent cards
    never read 4.59 Wh beside 900 J."""
    used = c.energy_j if c.energy_nodes else None
    emulated = c.emulated_energy_j if c.emulated_energy_nodes else None
    return common_scale((c.facility_joules_saved, used, emulated), ENERGY_UNITS)


def _listed(items: list[str]) -> str:
    more = len(items) - NOTE_ITEMS
    return "; ".join(items[:NOTE_ITEMS]) + (f"; +{more} more" if more > 0 else "")


def plan_inputs_note(c: Any, page_model: str) -> str:
    """The prefill inputs the agents' plans used (their own, not the page's), with a warning
    where they differ between nodes or from the page's chosen model."""
    if not c.plan_nodes:
        return ""
    # inputs whose plans saved nothing (a first scrape, an idle agent) price nothing
    used = {label: s for label, s in c.plan_inputs.items() if s}
    inputs = [f"{label}: {format_seconds(s)}" for label, s in sorted(used.items())]
    if not inputs:
        return ""
    note = f"plans' inputs: {_listed(inputs)}"
    if len(used) > 1:
        note += " (they differ: each node's seconds are of its own inputs)"
    named = {m for m, s in c.plan_models.items() if m and s}
    if named - {page_model}:
        note += f"; the page's model {page_model} applies only to nodes without plans"
    return note


def energy_saved_note(c: Any, page_model: str) -> str:
    """How "Energy saved" was priced: whose board power, which PUE, and what differs."""
    note = "GPU-s x board power x DC PUE"
    if c.plan_nodes:
        priced = {gpu: sec for gpu, sec in c.plan_energy_gpus.items() if sec}
        watts = [
            f"{gpu} {GPUS[gpu].board_power_watts:g} W ({format_seconds(sec)})"
            for gpu, sec in sorted(priced.items())
        ]
        note += (
            "; plans' seconds x the board power of the GPU their rate was for (the node's own "
            f"where it names none): {_listed(watts)}"
        )
        if len(priced) > 1:
            note += " (GPUs differ between nodes)"
        if c.plan_gpu_mismatches:
            note += f"; plans' GPU is not the inventory's: {_listed(sorted(c.plan_gpu_mismatches))}"
    if c.token_model_nodes:
        note += (
            f"; {c.token_model_nodes} node(s) without plans: tokens at {page_model} on each "
            "node's own GPU (the page's inputs)"
        )
    if c.pue_unknown_nodes:
        note += f"; PUE unknown for {c.pue_unknown_nodes} node(s): IT energy"
    return note
