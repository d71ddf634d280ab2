"""The demo summary's energy lines: one unit for the family, and each names its basis (the
review saw "13.2 kJ" saved beside the dashboard's "4.59 Wh", IT beside facility energy)."""

from __future__ import annotations

from kvctl.cli.demo import energy_lines


def test_saved_and_used_read_in_one_unit_and_say_it_or_facility() -> None:
    emulated = {
        "nodes": 4,
        "energy_j": 4_248.0,
        "busy_s": 59.0,
        "gpu": "l4",
        "board_power_watts": 72.0,
        "board_power_source": "NVIDIA L4 datasheet: 72 W max TDP",
        "tokens_per_joule": 0.8,
    }
    saved, used = energy_lines({"measured": {"nodes": 0}, "emulated": emulated}, 13_200.0)
    assert "3.67 Wh" in saved and "kJ" not in saved and " J" not in saved
    assert "IT" in saved and "facility" in saved  # the dashboard's figure is x PUE
    assert "1.18 Wh" in used and "IT" in used and "whole chunks only" in used
    # busy time is capped at each scrape interval (collectors.rows): prefill past it is in no
    # figure, which the line says rather than calling it all the tokens' prefill
    assert "at most each scrape interval" in used


def test_no_energy_read_still_says_what_was_saved() -> None:
    (line,) = energy_lines(None, 500.0)
    assert "500 J" in line and "IT" in line
