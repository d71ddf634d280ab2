"""`kvctl bench ttft`'s answer check, on constructed samples: a reuse of exactly the full
prefill's KV bytes must answer as the split reference (the full prefill's own KV cropped, then
the new tokens on it) up to atol, even where one-pass vs two-pass rounding moved the logits and
the next token away from the full prefill's (seen on the Llama-3.1-8B shape in bf16 at 100k
tokens); anything else is a failed sample."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvctl.bench.ttft import ATOL, _check, _Split, last_level_cache_bytes  # noqa: E402
from kvctl.engines.hf import Prefill  # noqa: E402

CHUNK = 256
CHUNKS = 4


def _logits(top: int, shift: float = 0.0) -> torch.Tensor:
    out = torch.linspace(-4.0, 4.0, 100) + shift
    out[top] = 12.0
    return out


def _prefill(logits: torch.Tensor, reused_chunks: int = CHUNKS, tier: str = "cpu") -> Prefill:
    return Prefill(
        logits=logits,
        next_token=int(logits.argmax()),
        cache=None,
        prompt_tokens=CHUNKS * CHUNK + 64,
        reused_tokens=reused_chunks * CHUNK,
        reused_chunks=reused_chunks,
        reused_tiers=[tier] * reused_chunks,
        fetched_bytes=0,
        lookup_seconds=0.0,
        fetch_seconds=0.0,
        compute_seconds=0.0,
    )


def _split(logits: torch.Tensor, full: Prefill) -> _Split:
    token = int(logits.argmax())
    diff = float((logits - full.logits).abs().max())
    return _Split(CHUNKS * CHUNK, logits, token, diff, token == full.next_token)


def test_the_split_reference_decides_when_rounding_moved_the_next_token() -> None:
    full = _prefill(_logits(7))
    split = _split(_logits(9, shift=0.25), full)  # two-pass rounding: another argmax
    got = _check(_prefill(split.logits.clone()), full, split, "cpu", CHUNKS, "bfloat16")
    assert got.timings["max_logit_diff_to_split"] == 0.0
    assert got.timings["max_logit_diff"] == pytest.approx(split.diff_to_full)


def test_bytes_that_differ_from_the_split_reference_fail() -> None:
    full = _prefill(_logits(7))
    split = _split(_logits(7, shift=0.01), full)
    wrong = split.logits.clone()
    wrong[3] += 4 * ATOL["bfloat16"]  # same next token, within the full-prefill tolerance
    with pytest.raises(RuntimeError, match="to the split reference"):
        _check(_prefill(wrong), full, split, "cpu", CHUNKS, "bfloat16")


def test_a_planned_recompute_is_checked_against_the_full_prefill() -> None:
    full = _prefill(_logits(7))
    split = _split(_logits(7, shift=0.01), full)
    fewer = _check(
        _prefill(_logits(7, shift=0.02), reused_chunks=2), full, split, "cpu", 4, "bfloat16"
    )
    assert "max_logit_diff_to_split" not in fewer.timings
    assert fewer.timings["planned_recompute_chunks"] == 2
    with pytest.raises(RuntimeError, match="expected 7"):
        _check(_prefill(_logits(8), reused_chunks=2), full, split, "cpu", 4, "bfloat16")


def test_chunks_from_the_wrong_tier_fail() -> None:
    full = _prefill(_logits(7))
    split = _split(full.logits.clone(), full)
    with pytest.raises(RuntimeError, match="from the cpu tier"):
        _check(_prefill(full.logits.clone(), tier="disk"), full, split, "cpu", CHUNKS, "bfloat16")


def _cache(root: Path, cpu: int, index: int, level: int, size: str, shared: str) -> None:
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_the_last_level_caches_are_counted_once_each(tmp_path: Path) -> None:
    """Two sockets of two CPUs each: their L3s add up, a cache shared by two CPUs counts once,
    the lower levels not at all; nothing readable falls back to 64 MiB."""
    for cpu in range(4):
        _cache(tmp_path, cpu, 0, 1, "48K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "2048K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "48M", "0-1" if cpu < 2 else "2-3")
    assert last_level_cache_bytes(tmp_path) == 96 << 20
    _cache(tmp_path, 0, 4, 3, "bad", "0")  # unreadable: skipped
    assert last_level_cache_bytes(tmp_path) == 96 << 20
    assert last_level_cache_bytes(tmp_path / "none") == 64 << 20


def test_a_source_the_plan_recomputed_says_why_and_from_which_figures() -> None:
    from kvctl.bench.ttft import _one_line

    summary = {
        "ttft_seconds": 1.395,
        "speedup": 1.01,
        "bound": {"fetch_share_of_bound": None},
        "plan": {
            "reason": "slower-than-recompute",
            "links": {
                "pool": {
                    "rtt_s": 0.0012,
                    "bandwidth_bytes_per_s": 3.1e9,
                    "source": "measured",
                    "override": "auto",
                }
            },
            "prefill": {"tokens_per_s": 23_000.0, "basis": "measured: 12 samples"},
        },
    }
    line = _one_line("pool", summary)
    assert "nothing fetched (plan: slower-than-recompute; " in line
    assert "pool 3.10 GB/s rtt 1.20 ms (measured)" in line
    assert "prefill 23,000 tokens/s (measured: 12 samples)" in line
    assert _one_line("pool", {**summary, "plan": None}).endswith("nothing fetched")


class _Puller:
    """Constructed prefills, one per try, and the flushes between them."""

    def __init__(self, reused: list[int]) -> None:
        self.reused = list(reused)
        self.flushes = 0

    def prefill(self, prompt: object) -> Prefill:
        return _prefill(_logits(3), reused_chunks=self.reused.pop(0), tier="remote")

    def flush(self) -> None:
        self.flushes += 1


class _Control:
    def __init__(self, late: list[int]) -> None:
        self.late = list(late)

    def remote(self) -> dict[str, object]:
        return {"pool": {"late": self.late.pop(0)}}


class _Fleet:
    def __init__(self, late: list[int]) -> None:
        self.control = {"puller": _Control(late)}
        self.prepared: list[str] = []

    def prepare(self, source: str, keys: list[bytes]) -> None:
        self.prepared.append(source)


def _pull(fleet: _Fleet, puller: _Puller, short: list[dict[str, object]]) -> Prefill:
    from kvctl.bench.ttft import _forced_pull

    keys = [bytes([i]) * 32 for i in range(CHUNKS)]
    return _forced_pull(fleet, lambda e: e, puller, "prompt", keys, short)  # type: ignore[arg-type]


def test_a_forced_pull_that_came_short_is_reported_and_tried_again() -> None:
    # the first try's lookup went on without the pool's answer: recomputed everything
    fleet, puller, short = _Fleet([0, 1, 1, 1]), _Puller([0, CHUNKS]), []
    got = _pull(fleet, puller, short)
    assert got.reused_chunks == CHUNKS
    assert short == [{"reused_chunks": 0, "late_probes": 1}]
    # what the short try wrote behind was stored, then forgotten before the next try
    assert puller.flushes == 1 and fleet.prepared == ["pool"]


def test_a_forced_pull_short_every_try_fails_with_its_tries() -> None:
    from kvctl.bench.ttft import FORCED_PULL_TRIES

    tries = FORCED_PULL_TRIES
    fleet, puller, short = _Fleet([0] * (2 * tries)), _Puller([1] * tries), []
    with pytest.raises(RuntimeError, match=f"fewer than {CHUNKS} chunks in {tries} tries"):
        _pull(fleet, puller, short)
    assert short == [{"reused_chunks": 1, "late_probes": 0}] * tries
