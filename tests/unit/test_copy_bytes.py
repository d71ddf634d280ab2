"""``copy_bytes``: every byte lands, whatever path a copy's size takes (a plain assignment, one
GIL-free numpy copy, or parts on threads), and nothing outside the destination changes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvctl.store.tiers import base
from kvctl.store.tiers.base import copy_bytes


@pytest.mark.parametrize(
    "n",
    [0, 1, base.GIL_FREE_COPY_BYTES - 1, base.GIL_FREE_COPY_BYTES, (5 << 20) + 3, 32 << 20],
)
def test_every_byte_lands_and_the_neighbours_stay(n: int) -> None:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.full(n + 2, 7, dtype=np.uint8)
    copy_bytes(memoryview(dst)[1 : n + 1], src)
    assert np.array_equal(dst[1 : n + 1], src)
    assert dst[0] == 7 and dst[-1] == 7


def test_a_split_copy_runs_its_parts_on_other_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "PARALLEL_COPY_PART_BYTES", 1 << 20)
    monkeypatch.setattr(base, "COPY_THREADS", 3)
    monkeypatch.setattr(base, "_copy_pool", None)
    seen: set[str] = set()
    real = np.copyto

    def spy(a: np.ndarray, b: np.ndarray) -> None:
        seen.add(threading.current_thread().name)
        real(a, b)

    monkeypatch.setattr(base.np, "copyto", spy)
    src = np.arange(4 << 20, dtype=np.uint8)  # four parts' worth, split three ways
    dst = np.zeros_like(src)
    copy_bytes(memoryview(dst), src)
    assert np.array_equal(dst, src)
    assert threading.current_thread().name in seen  # the caller copies a part itself
    assert any(name.startswith("kvctl-copy") for name in seen)
    base._copy_threads().shutdown()


def test_typed_sources_are_copied_as_bytes_and_lengths_must_match() -> None:
    src = np.arange(1 << 16, dtype=np.float32)  # 256 KiB, read byte for byte
    dst = bytearray(src.nbytes)
    copy_bytes(memoryview(dst), src)
    assert bytes(dst) == src.tobytes()
    with pytest.raises(ValueError, match="copying 4 bytes into 3"):
        copy_bytes(memoryview(bytearray(3)), b"abcd")
